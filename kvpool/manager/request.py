"""One request's state inside the manager: its tokens, block hashes and block table."""

from __future__ import annotations

from array import array
from typing import cast

from kvpool.hashing import BlockHasher
from kvpool.hashing.run_keys import RunKeyer, RunMemo
from kvpool.hashing.runs import TokenRuns
from kvpool.manager.validation import TOKEN_TYPECODE, count_tokens
from kvpool.pool.runs import add_run


class RequestState:
    """A request's tokens, the hashes of its full blocks, and its block table.

    The table and the chain of hashes are held as runs of consecutive ints
    (`kvpool.pool.runs`), what the pool's ``*_runs`` methods take, so no list of the
    request's blocks is built per call.

    Invariants the manager keeps (``bs`` = block size):
    - ``table`` holds block ids root first, as runs, ``num_blocks`` of them; block ``i``
      holds tokens ``[i*bs, (i+1)*bs)``.
    - ``computed <= min(len(tokens), num_blocks * bs)``: a token is computed only into
      a block the request holds.
    - With prefix caching on, ``chain`` holds the hashes of the full blocks as runs
      (``hashes`` spells them out), and the first ``visible`` table blocks are cached
      copies of the first ``visible`` of them, the rest private, with ``visible ==
      computed // bs`` (the visibility watermark). With it off, ``visible`` stays 0 and
      nothing is hashed.
    - ``num_tokens`` counts the tokens; ``tokens`` holds them, except with a `RunKeyer`
      (a manager with ``run_keys``), which needs no token and keeps none (``tokens``
      then stays empty).
    """

    __slots__ = (
        "_chain",
        "computed",
        "hasher",
        "keyer",
        "num_blocks",
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
        self._chain: list[int] = []  # with a hasher: its hashes as runs
        self.num_tokens = 0
        self.table: list[int] = []
        self.num_blocks = 0
        self.computed = 0
        self.visible = 0

    @property
    def chain(self) -> list[int]:
        """Hashes (or run keys) of every full block, as runs (empty when not hashing;
        the state's own list: read only)."""
        if self.keyer is not None:
            return self.keyer.runs
        return self._chain

    @property
    def hashes(self) -> list[int]:
        """Hashes (or run keys) of every full block, as a list (empty when not hashing;
        with a hasher, its own list: read only)."""
        if self.keyer is not None:
            return self.keyer.hashes
        return self.hasher.hashes if self.hasher is not None else []

    @property
    def num_hashed(self) -> int:
        """Full blocks hashed (or keyed) so far."""
        if self.keyer is not None:
            return self.keyer.num_blocks
        return len(self.hasher.hashes) if self.hasher is not None else 0

    def extend(self, tokens: array[int] | TokenRuns | range) -> None:
        """Append already-validated tokens (a ``range``: a run of u32 ids, step 1) and
        hash (or key) the blocks they complete."""
        self.num_tokens += count_tokens(tokens)
        keyer = self.keyer
        # `type() is`, not isinstance: TokenRuns is a Sequence, and an ABC's check is slow
        kind = type(tokens)
        if keyer is not None:
            if kind is range:
                keyer.extend_span(cast(range, tokens).start, len(tokens))
            elif kind is TokenRuns:
                keyer.extend(cast(TokenRuns, tokens))
            else:
                keyer.extend(TokenRuns.from_tokens(tokens))
            return
        if kind is range:
            tokens = array(TOKEN_TYPECODE, tokens)
        hasher = self.hasher
        if kind is TokenRuns:
            runs = cast(TokenRuns, tokens)
            packed = runs.to_array()
            self.tokens.extend(packed)
            if hasher is not None:
                if self.run_memo is not None:
                    new = hasher.extend_runs(runs, packed, self.run_memo)
                else:
                    new = hasher.extend(packed)
                for block_hash in new:
                    add_run(self._chain, block_hash, 1)
            return
        plain = cast("array[int]", tokens)
        self.tokens.extend(plain)
        if hasher is not None:
            for block_hash in hasher.extend(plain):
                add_run(self._chain, block_hash, 1)

    def reset(self) -> None:
        """Forget the table and the computed count (after its blocks were released)."""
        self.table = []
        self.num_blocks = 0
        self.computed = 0
        self.visible = 0


__all__ = ["RequestState"]
