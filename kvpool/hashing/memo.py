"""A bounded memo of whole chunks' sequence hashes: prompts that repeat a prefix (a
conversation's history, a shared system prompt) are hashed block by block only once.

A chunk is ``chunk_blocks`` consecutive full blocks starting at a block index that is a
multiple of ``chunk_blocks``, so two sequences that share a prefix cut it into the same
chunks. Its hashes are a pure function of the parent sequence hash and its tokens; the
memo keys them by the parent and the chunk's xxh3_128 digest, a 128-bit name for its
bytes (the block hashes themselves are 64-bit names, so the memo adds no collision that
the hashes do not already accept). The least recently used entry goes first once it is
full (an `OrderedDict`: dropping a plain dict's first key again and again makes each
``next(iter(d))`` scan the holes the earlier drops left).
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.block_hash import check_block_size, hash_packed_blocks

CHUNK_TOKENS = 256
"""Tokens per memoised chunk (at least one block): a chunk saves ``chunk_blocks`` block
hashes for one 128-bit digest and one dict lookup."""
MAX_ENTRIES = 8_192
"""Chunks remembered: about 7 MiB at 16-token blocks. On the multi-turn trace 2,048
miss no more than a million would (a prefix comes back soon after it is first seen)."""

_digest = xxhash.xxh3_128_intdigest


class ChunkMemo:
    """Sequence hashes of whole chunks of blocks, by (parent sequence hash, chunk digest).

    Owned by one manager (or shared by hashers of one ``block_size``); not thread-safe.
    """

    __slots__ = ("_block_size", "_chunk_blocks", "_entries", "_max_entries")

    def __init__(
        self, block_size: int, *, chunk_blocks: int | None = None, max_entries: int = MAX_ENTRIES
    ) -> None:
        """``chunk_blocks`` defaults to `CHUNK_TOKENS` worth of blocks (at least one).

        Raises `InvalidArgumentError` for a bad ``block_size``, ``chunk_blocks`` or
        ``max_entries`` (each an int >= 1).
        """
        check_block_size(block_size)
        if chunk_blocks is None:
            chunk_blocks = max(1, CHUNK_TOKENS // block_size)
        for name, value in (("chunk_blocks", chunk_blocks), ("max_entries", max_entries)):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        self._block_size = block_size
        self._chunk_blocks = chunk_blocks
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int | None, int], list[int]] = OrderedDict()

    @property
    def block_size(self) -> int:
        """Tokens per block of the chunks it remembers."""
        return self._block_size

    @property
    def chunk_blocks(self) -> int:
        """Blocks per chunk."""
        return self._chunk_blocks

    def __len__(self) -> int:
        return len(self._entries)

    def chunk_hashes(self, chunk: memoryview, parent: int | None) -> list[int]:
        """The sequence hashes of one whole chunk (``chunk``: its LE-``u32`` bytes, from
        `pack_tokens`) chained after ``parent``: remembered, or hashed now and
        remembered. The caller must not change the list it gets."""
        key = (parent, _digest(chunk))
        entries = self._entries
        hashes = entries.get(key)
        if hashes is not None:
            entries.move_to_end(key)
            return hashes
        hashes = hash_packed_blocks(chunk, self._block_size, parent)
        if len(entries) >= self._max_entries:
            entries.popitem(last=False)
        entries[key] = hashes
        return hashes


__all__ = ["CHUNK_TOKENS", "MAX_ENTRIES", "ChunkMemo"]
