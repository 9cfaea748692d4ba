"""One request's state inside the manager: its tokens, block hashes and block table."""

from __future__ import annotations

from array import array

from kvpool.hashing import BlockHasher
from kvpool.manager.validation import TOKEN_TYPECODE
from kvpool.pool import BlockId


class RequestState:
    """A request's tokens, the hashes of its full blocks, and its block table.

    Invariants the manager keeps (``bs`` = block size):
    - ``table`` holds block ids root first; block ``i`` holds tokens ``[i*bs, (i+1)*bs)``.
    - ``computed <= min(len(tokens), len(table) * bs)``: a token is computed only into
      a block the request holds.
    - With prefix caching on, the first ``visible`` table blocks are cached copies of
      ``hashes[:visible]`` and the rest are private, with ``visible == computed // bs``
      (the visibility watermark). With it off, ``visible`` stays 0 and nothing is hashed.
    """

    __slots__ = ("computed", "hasher", "table", "tokens", "visible")

    def __init__(self, hasher: BlockHasher | None) -> None:
        self.tokens: array[int] = array(TOKEN_TYPECODE)  # u32: 4 bytes a token
        self.hasher = hasher
        self.table: list[BlockId] = []
        self.computed = 0
        self.visible = 0

    @property
    def hashes(self) -> list[int]:
        """Sequence hashes of every full block of ``tokens`` (empty when not hashing)."""
        return self.hasher.hashes if self.hasher is not None else []

    def extend(self, tokens: array[int]) -> None:
        """Append already-validated tokens and hash the blocks they complete."""
        self.tokens.extend(tokens)
        if self.hasher is not None:
            self.hasher.extend(tokens)

    def reset(self) -> None:
        """Forget the table and the computed count (after its blocks were released)."""
        self.table = []
        self.computed = 0
        self.visible = 0


__all__ = ["RequestState"]
