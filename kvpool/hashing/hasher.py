"""Incremental per-request hashing: feed tokens as they arrive, get each newly full block.

A request's prompt is hashed once and each decode step adds a token or a few; re-hashing
the whole sequence every step would be quadratic. `BlockHasher` keeps the unfinished tail
and the last sequence hash, so each token is packed and hashed exactly once; with a
`ChunkMemo`, whole chunks another sequence already hashed are looked up instead.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import cast

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.block_hash import (
    check_block_size,
    check_parent,
    hash_packed_blocks,
    pack_tokens,
)
from kvpool.hashing.memo import ChunkMemo
from kvpool.hashing.run_keys import RunMemo
from kvpool.hashing.runs import TOKEN_MASK, TokenRuns


class BlockHasher:
    """Sequence hashes of a growing token sequence, one per full block, in order.

    Invariant: ``num_tokens == len(hashes) * block_size + len(tail)`` and ``hashes``
    equals ``block_hashes(all tokens so far, block_size, parent)``.
    """

    __slots__ = ("_block_size", "_hashes", "_last", "_memo", "_num_tokens", "_parent", "_tail")

    def __init__(
        self, block_size: object, parent: object = None, *, memo: ChunkMemo | None = None
    ) -> None:
        """Start an empty sequence; ``parent`` chains it after an existing block's hash;
        ``memo`` (of the same ``block_size``) remembers whole chunks across hashers.

        Raises `InvalidArgumentError` for a bad ``block_size`` or a memo of another
        block size, `InvalidHashError` for a bad ``parent``.
        """
        check_block_size(block_size)
        check_parent(parent)
        if memo is not None and memo.block_size != block_size:
            raise InvalidArgumentError(
                f"the memo hashes {memo.block_size}-token blocks, not {block_size}"
            )
        self._memo = memo
        self._block_size = cast(int, block_size)
        self._parent = cast("int | None", parent)
        self._last = self._parent  # sequence hash of the last full block (or the parent)
        self._hashes: list[int] = []
        self._tail = bytearray()  # LE-u32 bytes of the tokens after the last full block
        self._num_tokens = 0

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def parent(self) -> int | None:
        """The sequence hash this sequence is chained after (None at the start)."""
        return self._parent

    @property
    def hashes(self) -> list[int]:
        """Sequence hashes of every full block so far (the hasher's own list: read only)."""
        return self._hashes

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far, including the partial tail."""
        return self._num_tokens

    @property
    def tail_len(self) -> int:
        """Tokens after the last full block (always ``< block_size``)."""
        return len(self._tail) // 4

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """Feed ``tokens``; return the sequence hashes of the blocks they complete.

        Raises `InvalidArgumentError` if a token is not an int in ``[0, 2**32)``; the
        hasher is then unchanged.
        """
        packed = pack_tokens(tokens)  # validates every token before anything changes
        self._num_tokens += len(packed) // 4
        stride = self._block_size * 4
        if len(self._tail) + len(packed) < stride:
            self._tail += packed
            return []
        data = self._tail + packed if self._tail else packed
        full = len(data) - len(data) % stride
        view = memoryview(data)[:full]
        memo = self._memo
        if memo is None or full < memo.chunk_blocks * stride:
            new = hash_packed_blocks(view, self._block_size, self._last)
        else:
            new = self._hash_chunked(view, memo)
        self._tail = bytearray(data[full:])
        self._last = new[-1]
        self._hashes.extend(new)
        return new

    def extend_runs(self, tokens: TokenRuns, packed: array[int], memo: RunMemo) -> list[int]:
        """`extend` with ``tokens`` (``packed``: the same tokens as a u32 array): each run's
        whole blocks are hashed once per (parent, start, blocks) and looked up in
        ``memo`` after that, so a prefix that many prompts repeat is hashed once. The
        hashes are `extend`'s (Dynamo's); only the work differs."""
        if memo.block_size != self._block_size:
            raise InvalidArgumentError(
                f"the memo names {memo.block_size}-token blocks, not {self._block_size}"
            )
        bs = self._block_size
        new: list[int] = []
        pos = 0
        for start, length in tokens.runs:
            need = -self._num_tokens % bs  # tokens still missing from the partial block
            if need:
                take = min(need, length)
                new.extend(self.extend(packed[pos : pos + take]))
                pos += take
                start = (start + take) & TOKEN_MASK
                length -= take
            full = length // bs
            if full:
                hashes = memo.get(self._last, start, full)
                if hashes is None:
                    data = pack_tokens(packed[pos : pos + full * bs])
                    hashes = hash_packed_blocks(data, bs, self._last)
                    memo.put(self._last, start, full, hashes)
                self._hashes.extend(hashes)
                new.extend(hashes)
                self._last = hashes[-1]
                self._num_tokens += full * bs
                pos += full * bs
                length -= full * bs
            if length:
                new.extend(self.extend(packed[pos : pos + length]))
                pos += length
        return new

    def _hash_chunked(self, view: memoryview, memo: ChunkMemo) -> list[int]:
        """The hashes of the full blocks in ``view``, which follow the ones hashed so far:
        up to the next chunk boundary one by one, then whole chunks from the memo, then
        the rest one by one."""
        bs = self._block_size
        stride = bs * 4
        chunk = memo.chunk_blocks * stride
        skip = (-len(self._hashes) % memo.chunk_blocks) * stride
        new = hash_packed_blocks(view[:skip], bs, self._last) if skip else []
        parent = new[-1] if new else self._last
        pos = skip
        full = len(view)
        while pos + chunk <= full:
            hashes = memo.chunk_hashes(view[pos : pos + chunk], parent)
            new.extend(hashes)
            parent = hashes[-1]
            pos += chunk
        if pos < full:
            new.extend(hash_packed_blocks(view[pos:], bs, parent))
        return new

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self._block_size}, num_tokens={self._num_tokens}, "
            f"blocks={len(self._hashes)})"
        )


__all__ = ["BlockHasher"]
