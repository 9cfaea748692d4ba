"""Token sequences as runs of consecutive ids, and cheap chained block keys computed from
the runs without building a token.

A workload's prompt is a list of segments whose tokens are ``(seed + j) mod 2**32``
(`kvpool.workloads.spec`): a run. `TokenRuns` carries such a sequence as its runs, so a
caller can hand a 4,000-token prompt over as a few pairs of ints. With KV events off no
hash leaves the process, so a block needs a name that is equal exactly when its tokens
and its whole prefix are, not Dynamo's name: `RunKeyer` chains one xxh3_64 per block over
the parent key and the block's tokens described as maximal runs (a token sequence has
one decomposition into maximal runs of consecutive ids, so equal blocks get equal
descriptions however the runs were cut), and memoises whole runs by (parent key, start,
blocks), so a prefix that many prompts repeat costs one dict lookup per segment.

Keys are not Dynamo's hashes: a manager uses one scheme or the other, never both
(`kvpool.manager.KvManager`'s ``run_keys``).
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import overload

import xxhash

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.block_hash import TOKEN_TYPECODE, check_block_size

TOKEN_MASK = (1 << 32) - 1
ROOT_KEY = 0x6B76706F6F6C2D31
"""The parent key of a sequence's first block (any constant: keys never leave the process)."""
MAX_RUN_ENTRIES = 16_384
"""Runs remembered by a `RunKeyer`'s memo (a list of keys each)."""

_xxh3 = xxhash.xxh3_64_intdigest
_SEED = 0x4B4559  # keeps keys apart from Dynamo's seed-1337 hashes (not required: hygiene)
_pack_one = struct.Struct("<QII").pack


class TokenRuns(Sequence[int]):
    """A token sequence held as runs ``(start, length)``: tokens ``(start + j) mod 2**32``
    for ``j < length``, run after run. Immutable; a `Sequence` of its tokens, so any
    caller that takes token ids takes it (indexing builds a token; `to_array` all)."""

    __slots__ = ("_len", "_tokens", "runs")

    def __init__(
        self, runs: Sequence[tuple[int, int]], *, tokens: array[int] | None = None
    ) -> None:
        """Raises `InvalidArgumentError` unless each run is a pair of ints, a start in
        ``[0, 2**32)`` and a length ``>= 0`` (empty runs are dropped). ``tokens``, if
        given, must be the runs' tokens as a u32 array, built already (a workload's
        cached segments): `to_array` then copies it instead of building them."""
        kept: list[tuple[int, int]] = []
        total = 0
        for run in runs:
            if type(run) is not tuple or len(run) != 2:
                raise InvalidArgumentError(f"a token run must be (start, length), got {run!r}")
            start, length = run
            if type(start) is not int or not 0 <= start <= TOKEN_MASK:
                raise InvalidArgumentError(f"a run's start must be a u32 token, got {start!r}")
            if type(length) is not int or length < 0:
                raise InvalidArgumentError(f"a run's length must be an int >= 0, got {length!r}")
            if length:
                kept.append(run)
                total += length
        self.runs: tuple[tuple[int, int], ...] = tuple(kept)
        self._len = total
        if tokens is not None and len(tokens) != total:
            raise InvalidArgumentError(f"{len(tokens)} tokens given for runs of {total}")
        self._tokens = tokens

    @classmethod
    def from_tokens(cls, tokens: Sequence[int]) -> TokenRuns:
        """The maximal runs of already-validated u32 ``tokens`` (one pass over them)."""
        runs: list[tuple[int, int]] = []
        start = -1
        length = 0
        expect = -1
        for token in tokens:
            if token == expect:
                length += 1
            else:
                if length:
                    runs.append((start, length))
                start, length = token, 1
            expect = (token + 1) & TOKEN_MASK
        if length:
            runs.append((start, length))
        return cls(runs)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.to_array()[index].tolist()
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token index out of range")
        for start, length in self.runs:
            if index < length:
                return (start + index) & TOKEN_MASK
            index -= length
        raise AssertionError("unreachable")  # pragma: no cover

    def __iter__(self) -> Iterator[int]:
        for start, length in self.runs:
            for j in range(length):
                yield (start + j) & TOKEN_MASK

    def __repr__(self) -> str:
        return f"TokenRuns({list(self.runs)!r})"

    def to_array(self) -> array[int]:
        """The tokens as a fresh ``u32`` array (`TOKEN_TYPECODE`)."""
        if self._tokens is not None:
            return array(TOKEN_TYPECODE, self._tokens)
        tokens = array(TOKEN_TYPECODE)
        for start, length in self.runs:
            if start + length <= TOKEN_MASK + 1:
                tokens.extend(range(start, start + length))
            else:
                tokens.extend((start + j) & TOKEN_MASK for j in range(length))
        return tokens


def _block_key(parent: int, pieces: list[int]) -> int:
    """The key of a block after ``parent`` whose tokens are the maximal runs
    ``pieces`` (flat: start, length, start, length, ...)."""
    if len(pieces) == 2:
        return _xxh3(_pack_one(parent, pieces[0], pieces[1]), _SEED)
    return _xxh3(struct.pack(f"<Q{len(pieces)}I", parent, *pieces), _SEED)


class RunKeyer:
    """Chained keys of a growing token sequence fed as runs, one per full block: the
    `kvpool.hashing.BlockHasher` of a manager with ``run_keys``.

    Invariant: ``hashes`` holds one key per full block so far; ``_tail`` the maximal runs
    (flat pairs) of the tokens after the last full block, ``_tail_len`` their count.
    Two sequences get the same key for block ``i`` exactly when their tokens up to the
    end of block ``i`` are equal (up to a 64-bit collision, as with any hash).
    """

    __slots__ = ("_block_size", "_hashes", "_last", "_memo", "_num_tokens", "_tail", "_tail_len")

    def __init__(self, block_size: int, *, memo: RunMemo | None = None) -> None:
        """Raises `InvalidArgumentError` for a bad ``block_size`` or a memo of another."""
        check_block_size(block_size)
        if memo is not None and memo.block_size != block_size:
            raise InvalidArgumentError(
                f"the memo keys {memo.block_size}-token blocks, not {block_size}"
            )
        self._block_size = block_size
        self._memo = memo
        self._last = ROOT_KEY
        self._hashes: list[int] = []
        self._tail: list[int] = []
        self._tail_len = 0
        self._num_tokens = 0

    @property
    def hashes(self) -> list[int]:
        """Keys of every full block so far (the keyer's own list: read only)."""
        return self._hashes

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far."""
        return self._num_tokens

    def extend(self, tokens: TokenRuns) -> list[int]:
        """Feed ``tokens``; return the keys of the blocks they complete."""
        before = len(self._hashes)
        for start, length in tokens.runs:
            self.extend_span(start, length)
        return self._hashes[before:]

    def extend_span(self, start: int, length: int) -> None:
        """Feed the run of ``length`` tokens from token ``start`` (a u32; ``length >=
        0``), as `extend` would; its new keys join ``hashes``."""
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
            self._last = _block_key(self._last, tail)
            self._hashes.append(self._last)
            self._tail = []
            self._tail_len = 0
            start = (start + take) & TOKEN_MASK
            length -= take
        full = length // bs
        if full:
            memo = self._memo
            if memo is None:
                keys = _run_keys(self._last, start, full, bs)
            else:
                keys = memo.run_keys(self._last, start, full)
            self._hashes.extend(keys)
            self._last = keys[-1]
            start = (start + full * bs) & TOKEN_MASK
            length -= full * bs
        if length:
            self._tail = [start, length]
            self._tail_len = length

    def __repr__(self) -> str:
        return (
            f"RunKeyer(block_size={self._block_size}, num_tokens={self._num_tokens}, "
            f"blocks={len(self._hashes)})"
        )


def _run_keys(parent: int, start: int, blocks: int, block_size: int) -> list[int]:
    """Keys of ``blocks`` full blocks of one run from ``start``, chained after ``parent``."""
    keys: list[int] = []
    append = keys.append
    for i in range(blocks):
        parent = _xxh3(_pack_one(parent, (start + i * block_size) & TOKEN_MASK, block_size), _SEED)
        append(parent)
    return keys


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

    def run_keys(self, parent: int, start: int, blocks: int) -> list[int]:
        """`_run_keys`, remembered (the caller must not change the list)."""
        keys = self.get(parent, start, blocks)
        if keys is None:
            keys = _run_keys(parent, start, blocks, self._block_size)
            self.put(parent, start, blocks, keys)
        return keys

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


__all__ = ["MAX_RUN_ENTRIES", "ROOT_KEY", "RunKeyer", "RunMemo", "TokenRuns"]
