"""One request's state inside the manager: its tokens, block hashes and block table."""

from __future__ import annotations

from array import array

from kvpool.hashing import BlockHasher
from kvpool.hashing.run_keys import RunKeyer, RunMemo
from kvpool.hashing.runs import TokenRuns
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
    - ``num_tokens`` counts the tokens; ``tokens`` holds them, except with a `RunKeyer`
      (a manager with ``run_keys``), which needs no token and keeps none (``tokens``
      then stays empty).
    """

    __slots__ = (
        "computed",
        "hasher",
        "keyer",
        "num_tokens",
        "run_memo",
        "table",
        "tokens",
        "visible",
    )

    def __init__(
        self,
        hasher: BlockHasher | None,
        keyer: RunKeyer | None = None,
        run_memo: RunMemo | None = None,
    ) -> None:
        self.tokens: array[int] = array(TOKEN_TYPECODE)  # u32: 4 bytes a token
        self.hasher = hasher
        self.keyer = keyer
        self.run_memo = run_memo  # with a hasher: runs' hashes, shared by the manager
        self.num_tokens = 0
        self.table: list[BlockId] = []
        self.computed = 0
        self.visible = 0

    @property
    def hashes(self) -> list[int]:
        """Sequence hashes (or run keys) of every full block (empty when not hashing)."""
        if self.keyer is not None:
            return self.keyer.hashes
        return self.hasher.hashes if self.hasher is not None else []

    def extend(self, tokens: array[int] | TokenRuns | range) -> None:
        """Append already-validated tokens (a ``range``: a run of u32 ids, step 1) and
        hash (or key) the blocks they complete."""
        self.num_tokens += len(tokens)
        keyer = self.keyer
        if keyer is not None:
            if isinstance(tokens, range):
                keyer.extend_span(tokens.start, len(tokens))
            elif isinstance(tokens, TokenRuns):
                keyer.extend(tokens)
            else:
                keyer.extend(TokenRuns.from_tokens(tokens))
            return
        if isinstance(tokens, range):
            tokens = array(TOKEN_TYPECODE, tokens)
        if isinstance(tokens, TokenRuns):
            packed = tokens.to_array()
            self.tokens.extend(packed)
            if self.hasher is not None:
                if self.run_memo is not None:
                    self.hasher.extend_runs(tokens, packed, self.run_memo)
                else:
                    self.hasher.extend(packed)
            return
        self.tokens.extend(tokens)
        if self.hasher is not None:
            self.hasher.extend(tokens)

    def reset(self) -> None:
        """Forget the table and the computed count (after its blocks were released)."""
        self.table = []
        self.computed = 0
        self.visible = 0


__all__ = ["RequestState"]
