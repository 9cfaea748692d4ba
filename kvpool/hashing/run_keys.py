"""Cheap chained block keys of token runs (`kvpool.hashing.runs` says why): the
`RunKeyer` a manager with ``run_keys`` names its blocks with, and the `RunMemo` of whole
runs' Dynamo hashes a manager with events on shares across requests
(`kvpool.hashing.BlockHasher.extend_runs`).

setup.py compiles this module with mypyc (a decode step feeds a request's keyer once per
step); it runs interpreted just the same.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Final

import xxhash

from kvpool.hashing.block_hash import check_block_size
from kvpool.hashing.runs import TOKEN_MASK, TokenRuns
from kvpool.pool.runs import add_run, expand

ROOT_KEY = 0x6B76706F6F6C2D31
"""The parent key of a sequence's first block (any constant: keys never leave the process)."""
RANGE_BITS: Final = 6
"""Low key bits that number a block within its stretch (`RunKeyer`): a stretch is one hash
bucket of `kvpool.pool.BlockPool`, so a stretch's cached blocks are one of its extents."""
RANGE_BLOCKS: Final = 1 << RANGE_BITS
"""Blocks of one run keyed from one digest (a 512-token trace block is 32 of 16)."""
MAX_RUN_ENTRIES = 16_384
"""Runs remembered by a `RunMemo` (a list of names each)."""

_xxh3: Final = xxhash.xxh3_64_intdigest
_SEED: Final = 0x4B4559  # keeps keys apart from Dynamo's seed-1337 hashes (hygiene only)
_pack_one: Final = struct.Struct("<QII").pack
_pack_base: Final = struct.Struct("<QI").pack
_INDEX_MASK: Final = RANGE_BLOCKS - 1
# A stretch's keys stay under 2**62: each is a C long, so `range` counts them natively,
# and a short int to compiled code, so the pool checks and compares them as machine words.
_BASE_MASK: Final = ((1 << 62) - 1) ^ _INDEX_MASK


def _block_key(parent: int, pieces: list[int]) -> int:
    """The key of a block after ``parent`` whose tokens are the maximal runs
    ``pieces`` (flat: start, length, start, length, ...)."""
    if len(pieces) == 2:
        return _xxh3(_pack_one(parent, pieces[0], pieces[1]), _SEED)
    return _xxh3(struct.pack(f"<Q{len(pieces)}I", parent, *pieces), _SEED)


class RunKeyer:
    """Chained keys of a growing token sequence fed as runs, one per full block: the
    `kvpool.hashing.BlockHasher` of a manager with ``run_keys``.

    A block whose tokens are one run of consecutive ids is keyed in closed form: the
    first of a stretch gets ``xxh3(parent, start)`` with its low `RANGE_BITS` and its
    top two bits cleared (a *base*), and each block after it that continues the run takes
    the next key (base + 1, + 2, ..., `RANGE_BLOCKS` blocks a stretch), so a run of n
    blocks costs one digest and n additions, not n digests. A block of several runs gets one digest
    of them all (`_block_key`).

    The keys are kept as runs (`kvpool.pool.runs`: a stretch is one run), what the
    manager hands the pool's ``*_runs`` methods; ``hashes`` spells them out.

    Invariants: ``runs`` holds one key per full block so far; ``_tail`` the maximal
    runs (flat pairs) of the tokens after the last full block, ``_tail_len`` their
    count; ``_next`` is the start token a block needs to continue the last block's
    stretch (-1: none can: the last block was several runs, or its stretch is full).
    A base determines its start token (up to a collision of 56-bit digests), so a key is a
    function of the parent key and the block's tokens alone, however the runs were cut
    and fed: two sequences get the same key for block ``i`` exactly when their tokens
    up to the end of block ``i`` are equal.
    """

    __slots__ = (
        "_block_size",
        "_last",
        "_next",
        "_num_blocks",
        "_num_tokens",
        "_runs",
        "_tail",
        "_tail_len",
    )

    def __init__(self, block_size: int) -> None:
        """Raises `InvalidArgumentError` for a bad ``block_size``."""
        check_block_size(block_size)
        self._block_size = block_size
        self._last = ROOT_KEY
        self._next = -1  # the root is no stretch
        self._runs: list[int] = []
        self._num_blocks = 0
        self._tail: list[int] = []
        self._tail_len = 0
        self._num_tokens = 0

    @property
    def hashes(self) -> list[int]:
        """Keys of every full block so far, as a fresh list."""
        return expand(self._runs)

    @property
    def runs(self) -> list[int]:
        """Keys of every full block so far as runs (the keyer's own list: read only)."""
        return self._runs

    @property
    def num_blocks(self) -> int:
        """Full blocks so far."""
        return self._num_blocks

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far."""
        return self._num_tokens

    def extend(self, tokens: TokenRuns) -> None:
        """Feed ``tokens``; the keys of the blocks they complete join ``runs``."""
        for start, length in tokens.runs:
            self.extend_span(start, length)

    def extend_span(self, start: int, length: int) -> None:
        """Feed the run of ``length`` tokens from token ``start`` (a u32; ``length >=
        0``), as `extend` would; its new keys join ``runs``."""
        bs = self._block_size
        self._num_tokens += length
        if self._tail_len:  # fill the partial block first
            tail = self._tail
            take = min(length, bs - self._tail_len)
            if (tail[-2] + tail[-1]) & TOKEN_MASK == start:
                tail[-1] += take  # continues the last run: one maximal run
            else:
                tail.append(start)
                tail.append(take)
            self._tail_len += take
            if self._tail_len < bs:
                return
            if len(tail) == 2:  # one run after all: keyed as a span's block is
                self._key_run(tail[0], 1)
            else:
                self._last = _block_key(self._last, tail)
                self._next = -1
                add_run(self._runs, self._last, 1)
                self._num_blocks += 1
            tail.clear()  # the keyer's own list: reused, not rebuilt, block after block
            self._tail_len = 0
            start = (start + take) & TOKEN_MASK
            length -= take
        full = length // bs
        if full:
            self._key_run(start, full)
            start = (start + full * bs) & TOKEN_MASK
            length -= full * bs
        if length:
            tail = self._tail
            tail.append(start)  # empty: no partial block was left, or it just filled
            tail.append(length)
            self._tail_len = length

    def _key_run(self, start: int, blocks: int) -> None:
        """Key ``blocks >= 1`` full blocks of one run from token ``start``."""
        bs = self._block_size
        runs = self._runs
        last = self._last
        self._num_blocks += blocks
        while blocks:
            if start == self._next:
                key = last + 1  # continues the last block's stretch
            else:
                key = _xxh3(_pack_base(last, start), _SEED) & _BASE_MASK
            count = min(blocks, RANGE_BLOCKS - (key & _INDEX_MASK))
            add_run(runs, key, count)
            last = key + count - 1
            start = (start + count * bs) & TOKEN_MASK
            blocks -= count
            self._next = start if last & _INDEX_MASK != _INDEX_MASK else -1
        self._last = last

    def __repr__(self) -> str:
        return (
            f"RunKeyer(block_size={self._block_size}, num_tokens={self._num_tokens}, "
            f"blocks={self._num_blocks})"
        )


class RunMemo:
    """Names of whole runs of full blocks, by (parent name, start token, blocks): a
    prefix many prompts repeat is named once. Least recently used entries go first."""

    __slots__ = ("_block_size", "_entries", "_max_entries", "blocks_named", "hits", "misses")

    def __init__(self, block_size: int, *, max_entries: int = MAX_RUN_ENTRIES) -> None:
        check_block_size(block_size)
        self._block_size = block_size
        self._max_entries = max_entries
        self.hits = 0  # `get` calls answered
        self.misses = 0  # `get` calls not answered (the caller names the run: `put`)
        self.blocks_named = 0  # blocks in the runs `put` here
        self._entries: OrderedDict[tuple[int | None, int, int], list[int]] = OrderedDict()

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, parent: int | None, start: int, blocks: int) -> list[int] | None:
        """The names remembered for ``blocks`` full blocks of the run from token
        ``start`` chained after ``parent``, or None."""
        entry = (parent, start, blocks)
        keys = self._entries.get(entry)
        if keys is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(entry)
        return keys

    def put(self, parent: int | None, start: int, blocks: int, names: list[int]) -> None:
        """Remember ``names`` for `get` (one memo holds one kind of name: run keys, or
        Dynamo's hashes for `kvpool.hashing.BlockHasher.extend_runs`)."""
        entries = self._entries
        if len(entries) >= self._max_entries:
            entries.popitem(last=False)
        entries[(parent, start, blocks)] = names
        self.blocks_named += blocks


__all__ = ["MAX_RUN_ENTRIES", "ROOT_KEY", "RunKeyer", "RunMemo"]
