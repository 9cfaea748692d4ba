"""The synchronous, I/O-free block pool: the reference's semantics, validated and fast.

The reference keeps one record per physical copy. Here a record is an `Extent`: a run
of copies with consecutive ids, consecutive hashes (or all private), one refcount and
pin count, and consecutive LRU stamps, so the work of a call follows the runs it
touches, not its blocks: a request's prompt is a few runs of a chain (its trace blocks,
or the run keys `kvpool.hashing.run_keys` gives them), its table a few runs of ids, and
a release, an eviction or a prefix walk costs a step per run. Every answer is the
reference's, copy by copy: an operation that covers part of an extent splits it first
(`_split`), which changes nothing a caller can see.

Two indexes find extents:
- ``_pages``: a page's slot -> its 64 offsets, each the extent holding that id (None: not
  live), so an id finds its extent in two list reads, whatever the extents' sizes. A
  `BlockId` is ``serial << 38 | slot << 6 | offset``: a page takes a free slot and a
  serial never used before, claimed from a process-wide counter, so an id is never
  reused and an id from another pool never names a copy here, while the slots, reused,
  keep the index a list the size of the pages in use. Each allocation takes pages of its
  own (a table growing block by block continues its last page: `_new_private`); a run
  of hashes cached at allocation gets a page whose offsets are the hashes' own (``hash
  & 63``), so one run is one extent.
- ``_buckets``: ``hash >> 6`` (a hash bucket) -> the cached extents holding hashes of
  that bucket, in the order they were cached (the extent itself while it is the only
  one): a hash's *first copy* (the one `prefix_hit` reports) is the first extent of its
  bucket that holds it, and its later copies (physical duplicates) follow in order. A
  run key's stretch is one bucket. A hash above ``2**62 - 1`` (a token hash is one, a
  run key never) is no machine word to compiled code, so no arithmetic touches it: its
  bucket is the hash itself (`_bucket_key`: the two kinds of keys never meet) and its
  extents hold it alone.

The inactive LRU is intrusive and circular around a sentinel extent: ``sentinel.next``
is the head (evicted first), ``sentinel.prev`` the tail (released last), extents in
order of their stamps.

Every public method validates all of its arguments before it changes anything, so a
`PoolError` leaves the pool exactly as it was (a split made before a refusal changes no
answer). ``check_invariants`` re-derives everything from scratch to catch any slip.

Methods named ``*_runs`` are the range forms the request-level manager drives: chains
and tables as runs (flat ``first, count, first, count, ...`` lists of consecutive ints),
so that neither side builds a list of a request's blocks. The per-block methods are the
same operations with their arguments and results as lists.

This module is compiled with mypyc when the package is built (see setup.py), which
makes each call 2-3x cheaper; the same source runs interpreted when it is not. A
compiled function rejects an argument of the wrong type with a bare TypeError before
its body runs, so public parameters are typed ``object`` here and validated in the body
(raising kvpool's own errors); ``_api.pyi`` gives type checkers the precise signatures.
"""

from __future__ import annotations

from itertools import count
from typing import Final, NoReturn, cast

from kvpool.errors import (
    AlreadyCachedError,
    BlockNotReferencedError,
    BlockSharedError,
    CapacityError,
    ForeignReservationError,
    InvalidArgumentError,
    InvalidHashError,
    InvariantViolationError,
    PrefixNotResidentError,
    ReservationClosedError,
    ReservationExhaustedError,
    UnknownBlockError,
)
from kvpool.pool.extent import PIN, PRIVATE, REF_MASK, Extent
from kvpool.pool.items import as_list as _as_list
from kvpool.pool.runs import BOXED_BITS, add_descent, expand_descents, overlapping, slice_runs
from kvpool.pool.runs import add_run as _add_run
from kvpool.pool.runs import expand as _expand
from kvpool.pool.types import (
    ACTIVE_HIT,
    INACTIVE_HIT,
    MAX_HASH,
    Admission,
    BlockId,
    PrefixHit,
    Reservation,
    ReserveOutcome,
    RunAdmission,
)

_PAGE_BITS: Final = 6
_PAGE: Final = 1 << _PAGE_BITS
_PAGE_MASK: Final = _PAGE - 1
_BUCKET_BITS: Final = 6  # a run key's stretch: `kvpool.hashing.run_keys.RANGE_BITS`
_BUCKET: Final = 1 << _BUCKET_BITS
_BUCKET_MASK: Final = _BUCKET - 1
_MAX_CAPACITY: Final = 1 << 32
_SLOT_BITS: Final = 32  # live pages never outnumber live copies (< 2**32)
_SLOT_MASK: Final = (1 << _SLOT_BITS) - 1
_SERIAL_SHIFT: Final = _SLOT_BITS + _PAGE_BITS
_SERIALS_PER_RANGE: Final = 1 << 12
# Pools claim ranges of serials from one process-wide counter, so an id is unique across
# every pool in the process and the hot path needs no global state; two pools with one
# history give their copies ids equal in the low 32 bits (slot and offset).
_serial_ranges = count(1)
_PIN_TO_REF: Final = 1 - PIN  # added to ``holds``: one pin becomes one reference


class BlockPool:
    """vLLM's GPU block pool: copies, refcounts, pins, an inactive LRU, reservations.

    Not thread-safe; one owner (a thread or the pool actor) drives it.
    """

    __slots__ = (
        "_buckets",
        "_capacity",
        "_clock",
        "_evictions",
        "_free_pages",
        "_lru",
        "_next_serial",
        "_num_copies",
        "_num_inactive",
        "_page_ends",
        "_page_used",
        "_pages",
        "_refs",
        "_reserve_failures",
        "_reserved",
        "_reserves",
        "_serial_limit",
    )

    def __init__(self, capacity: object) -> None:
        # Set before anything can raise: __del__ reads these two.
        self._pages: list[list[Extent | None] | None] = []  # by slot; None: a free slot
        sentinel = Extent(-1, 0, PRIVATE, 1, -1)  # never inactive, never evicted
        sentinel.prev = sentinel.next = sentinel
        self._lru = sentinel
        if type(capacity) is not int or not 1 <= capacity < _MAX_CAPACITY:
            raise InvalidArgumentError(f"capacity must be an int in [1, 2**32), got {capacity!r}")
        self._capacity: int = capacity
        self._buckets: dict[int, Extent | list[Extent]] = {}
        # By slot, the next id of a page of private copies never handed out (else -1):
        # an allocation may continue there after its caller's last block (``after``), so
        # that a table growing block by block stays one run of ids, its blocks one extent.
        self._page_ends: list[int] = []
        self._page_used: list[int] = []  # by slot: its live copies
        self._free_pages: list[int] = []  # slots, reused last freed first
        self._num_copies = 0
        self._num_inactive = 0
        self._clock = 0  # stamps copies as requests let go of them (Extent.stamp)
        self._reserved = 0
        self._refs = 0  # request references: one per private copy plus cached refs
        # Cumulative counters (kvpool's one source of them; see `reserves`).
        self._reserves = 0
        self._reserve_failures = 0
        self._evictions = 0
        self._next_serial = 0
        self._serial_limit = 0

    def __del__(self) -> None:
        # Compiled extents are invisible to the cyclic collector (see Extent), so the
        # LRU ring is unlinked by hand; bounded, in case a test corrupted the links.
        sentinel = self._lru
        node = sentinel.next
        for _ in range(len(self._pages) * _PAGE + 1):
            if node is None or node is sentinel:
                break
            following = node.next
            node.prev = node.next = None
            node = following
        sentinel.prev = sentinel.next = None

    def __repr__(self) -> str:
        return (
            f"BlockPool(capacity={self._capacity}, active={self.num_active()}, "
            f"inactive={self._num_inactive})"
        )

    @property
    def capacity(self) -> int:
        """Total physical blocks."""
        return self._capacity

    @property
    def reserves(self) -> int:
        """Successful reservations so far: every `reserve` and `admit` that fit."""
        return self._reserves

    @property
    def reserve_failures(self) -> int:
        """Calls of `reserve` or `admit` that returned None: the blocks did not fit."""
        return self._reserve_failures

    @property
    def evictions(self) -> int:
        """Copies evicted from the inactive LRU so far (duplicates of a hash included)."""
        return self._evictions

    # ----------------------------------------------------------------- queries

    def prefix_hit(self, block_hash: object) -> PrefixHit | None:
        """Whether ``block_hash`` is resident, and whether its first copy is in use."""
        found, _ = self._first_span(block_hash, 1)
        if found is None:
            return None
        return ACTIVE_HIT if found.holds else INACTIVE_HIT

    def match_prefix(self, hashes: object, limit: object = None) -> tuple[int, int]:
        """Walk ``hashes`` root first until the first miss (at most ``limit`` of them).

        Returns ``(hits, active)``: how many leading hashes are resident and how many of
        those have an active first copy; the answers of one `prefix_hit` per hash, in
        one call. Raises `InvalidHashError` for a malformed hash before the first miss.
        """
        keys = hashes if type(hashes) is list else _as_list(hashes)
        walk = _check_limit(limit, len(keys))
        return self._walk(_runs_of(keys), walk, None)

    def match_runs(self, runs: object, limit: object = None) -> tuple[int, int]:
        """`match_prefix` of the chain ``runs`` (runs of consecutive hashes, flat
        ``first, count`` pairs: `check_runs`' rules)."""
        chain, size = _checked_runs(runs, "runs")
        return self._walk(chain, _check_limit(limit, size), None)

    def any_resident(self, hashes: object) -> bool:
        """Whether any of ``hashes`` has a resident copy: `prefix_hit` of each, in one call.

        Raises `InvalidHashError` for a malformed hash among those read before a resident one.
        """
        keys = hashes if type(hashes) is list else _as_list(hashes)
        return self._any_resident(_runs_of(keys))

    def any_resident_runs(self, runs: object) -> bool:
        """`any_resident` of the hashes ``runs`` holds (flat ``first, count`` pairs)."""
        chain, _ = _checked_runs(runs, "runs")
        return self._any_resident(chain)

    def evicts_last_copies(self, count: object) -> bool:
        """Whether evicting the next ``count`` inactive copies (from the LRU head) would
        remove each one's hash: no other copy of it is resident. A query; raises
        `InvalidArgumentError` unless ``count`` is an int in ``[0, num_inactive()]``."""
        if type(count) is not int or not 0 <= count <= self._num_inactive:
            raise InvalidArgumentError(
                f"count must be an int in [0, {self._num_inactive}], got {count!r}"
            )
        sentinel = self._lru
        node = cast(Extent, sentinel.next)
        while count > 0:
            if not self._alone_in(node):
                return False
            count -= node.n
            node = cast(Extent, node.next)
        return True

    def num_active(self) -> int:
        """Copies in use plus reserved capacity: what vLLM reports as used blocks."""
        return self._num_copies - self._num_inactive + self._reserved

    def num_active_refs(self) -> int:
        """Request references held: one per private copy plus every cached ref."""
        return self._refs

    def num_inactive(self) -> int:
        """Cached copies with no reference and no pin: the evictable LRU."""
        return self._num_inactive

    # ------------------------------------------------------------ reservations

    def reserve(self, prefix: object, fresh: object) -> ReserveOutcome | None:
        """Atomically pin the resident ``prefix`` and reserve ``fresh`` more blocks.

        Returns None, changing nothing, when the blocks do not fit even after evicting
        every unpinned inactive copy. ``removed`` lists, in eviction order, the hashes
        whose last resident copy was evicted to make room.
        """
        if type(fresh) is not int or fresh < 0:
            raise InvalidArgumentError(f"fresh must be an int >= 0, got {fresh!r}")
        hashes = prefix if type(prefix) is list else _as_list(prefix)
        runs = _runs_of(hashes)
        pieces: list[int] = []
        found = 0
        for r in range(0, len(runs), 2):
            key = runs[r]
            left = cast(int, runs[r + 1])
            while left:
                first, span = self._first_span(key, left)
                if first is None:
                    raise PrefixNotResidentError(
                        f"prefix hash {key} is not resident; look a prefix up with "
                        "prefix_hit in the same turn as its reserve"
                    )
                _add_run(
                    pieces, first.id + (0 if span == first.n else cast(int, key) - first.hash), span
                )
                found += span
                left -= span
                if left:
                    key = cast(int, key) + span
        removed = self._pin_and_reserve(pieces, found, fresh, PIN)
        if removed is None:
            return None
        return ReserveOutcome(Reservation(self, pieces, found, fresh), expand_descents(removed))

    def admit(
        self,
        chain: object,
        extra: object = 0,
        *,
        blocks: object = None,
        limit: object = None,
        cache: object = 0,
    ) -> Admission | None:
        """One request's blocks in one call: reference the longest resident prefix of
        ``chain`` (up to the first miss) and allocate private copies for the rest of the
        chain plus ``extra`` more.

        The same as `match_prefix`, `reserve` of the hits plus the rest, `activate_prefix`,
        `allocate_private` for every fresh unit and `cancel`, without the reservation in
        between. Returns None, changing nothing, when it does not fit; raises
        `InvalidHashError` for any malformed hash in ``chain`` and `CapacityError` for a
        chain that could not fit even in an empty pool.

        With ``blocks`` (an int >= 0; ``extra`` must then be 0) the fresh copies are
        counted from the prefix found instead: the result holds ``max(hits, blocks)``
        blocks, the hits then fresh ones, and the chain past its first miss is never
        read (as `match_prefix`: only a malformed hash up to the first miss raises). A
        request's first allocation is one walk of its prefix this way, not a
        `match_prefix` to count the fresh blocks and a second walk here. Two more
        arguments need ``blocks``: ``limit`` (an int >= 0 or None) walks at most that
        many leading hashes for the prefix (`match_prefix`'s limit), and ``cache`` (an
        int, ``0 <= cache <= min(len(chain), blocks)``) makes each fresh block ``i <
        cache`` findable under ``chain[i]`` as `cache_chain` of those blocks and hashes
        right after would, its flags in ``stored``: a caller that fills the blocks it is
        given at once (a prompt's full blocks) makes one call, not two. Every hash the
        call reads is checked before anything changes.
        """
        hashes = chain if type(chain) is list else _as_list(chain, "chain")
        admitted = self._admit(_runs_of(hashes), len(hashes), extra, blocks, limit, cache)
        if admitted is None:
            return None
        return Admission(
            cast("list[BlockId]", _expand(admitted.ids)),
            admitted.cached,
            admitted.active_cached,
            expand_descents(admitted.removed),
            _flags(admitted.stored, max(cast(int, cache) - admitted.cached, 0)),
        )

    def admit_runs(
        self,
        chain: object,
        *,
        blocks: object,
        limit: object = None,
        cache: object = 0,
        after: object = -1,
    ) -> RunAdmission | None:
        """`admit` of the chain ``chain`` (runs of consecutive hashes, flat ``first,
        count`` pairs) with ``blocks``, its ids as runs (`RunAdmission`): a request's
        first allocation with no list of its blocks built on either side.

        ``after`` (an int; -1: none) is the id of the caller's last block, which fresh
        private copies follow when they can (the next ids were never handed out): a
        hint that changes which ids the copies get, nothing else."""
        runs, size = _checked_runs(chain, "chain")
        if blocks is None:
            raise InvalidArgumentError("admit_runs needs blocks")
        if type(after) is not int:
            raise InvalidArgumentError(f"after must be an int, got {after!r}")
        return self._admit(runs, size, 0, blocks, limit, cache, after)

    def _admit(
        self,
        runs: list[object],
        size: int,
        extra: object,
        blocks: object,
        limit: object,
        cache: object,
        after: int = -1,
    ) -> RunAdmission | None:
        """`admit` of the chain ``runs`` (unchecked runs of ``size`` hashes)."""
        walk = size
        wanted = -1  # no ``blocks``: fresh copies for the chain's misses plus ``extra``
        stored_upto = 0
        if blocks is not None:
            if type(blocks) is not int or blocks < 0:
                raise InvalidArgumentError(f"blocks must be an int >= 0 or None, got {blocks!r}")
            if extra != 0:
                raise InvalidArgumentError(f"extra must be 0 with blocks, got {extra!r}")
            if limit is not None:
                if type(limit) is not int or limit < 0:
                    raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}")
                walk = min(limit, size)
            if type(cache) is not int or not 0 <= cache <= min(size, blocks):
                raise InvalidArgumentError(
                    f"cache must be an int in [0, {min(size, blocks)}], got {cache!r}"
                )
            wanted = blocks
            stored_upto = cache
        elif limit is not None or cache != 0:
            raise InvalidArgumentError("limit and cache need blocks")
        pieces: list[int] = []
        hits, active = self._walk(runs, walk, pieces)
        if wanted < 0:
            # _walk checked the hashes up to the first miss, the miss included.
            _check_hashes(runs, hits + 1, size)
            if type(extra) is not int or extra < 0:
                raise InvalidArgumentError(f"extra must be an int >= 0, got {extra!r}")
            if size + extra > self._capacity:
                raise CapacityError(
                    f"a chain of {size} blocks plus {extra} extra can never fit "
                    f"in a pool of {self._capacity}"
                )
            fresh = size - hits + extra
        else:
            if wanted > self._capacity:
                raise CapacityError(f"{wanted} blocks can never fit in a pool of {self._capacity}")
            fresh = max(wanted - hits, 0)
            _check_hashes(runs, hits, stored_upto)
        removed = self._pin_and_reserve(pieces, hits, fresh, 1)
        if removed is None:
            return None
        stored: list[int] = []
        if stored_upto > hits:
            # checked: the hashes to cache are ints
            chosen = slice_runs(cast("list[int]", runs), hits, stored_upto)
            stored = self._new_cached(cast("list[object]", chosen), pieces)
        self._new_private(fresh - max(stored_upto - hits, 0), pieces, after)
        return RunAdmission(pieces, hits, active, removed, stored)

    def admit_each(
        self, counts: object, after: object = None
    ) -> tuple[list[BlockId], list[list[int]]] | None:
        """`admit` of no chain and ``extra=count`` for each of ``counts`` in order, all or
        nothing: the fresh ids of every admission in one list (in order) and each one's
        removed hashes, or None, changing nothing, when they do not all fit.

        The same copies, ids, evictions and counters as those calls one after another: a
        run of decode steps growing one table after another costs one call, not one
        `Admission` per table. ``after`` (None, or one int per count) gives each
        admission `admit_runs`' hint: the id of its table's last block before this call
        (-1: none); admissions of one table name the same id, and each follows the
        one before it.
        Raises `InvalidArgumentError` for a count that is not an int >= 0 or a bad
        ``after``, and `CapacityError` for a count that could never fit.
        """
        wanted, hints, total = self._check_counts(counts, after)
        admitted = self._admit_each(wanted, hints, total, True)
        if admitted is None:
            return None
        runs, removed = admitted
        return cast("list[BlockId]", _expand(runs)), [expand_descents(gone) for gone in removed]

    def admit_each_runs(
        self, counts: object, after: object = None
    ) -> tuple[list[int], list[int]] | None:
        """`admit_each` with its ids as runs (flat ``first, count`` pairs: the counts'
        ids one after another) and the hashes all its admissions removed as one list of
        descending runs (`kvpool.pool.runs.add_descent`): a run of decode steps' tables
        grown with no list of their blocks or hashes. The same checks and effect."""
        wanted, hints, total = self._check_counts(counts, after)
        admitted = self._admit_each(wanted, hints, total, False)
        if admitted is None:
            return None
        runs, removed = admitted
        return runs, removed[0] if removed else []

    def _check_counts(
        self, counts: object, after: object
    ) -> tuple[list[object], list[object], int]:
        """`admit_each`'s checks, before anything changes: the counts, the hints (empty:
        none) and the blocks they add up to."""
        wanted = counts if type(counts) is list else _as_list(counts, "counts")
        total = 0
        for fresh in wanted:
            if type(fresh) is not int or fresh < 0:
                raise InvalidArgumentError(f"counts must be ints >= 0, got {fresh!r}")
            if fresh > self._capacity:
                raise CapacityError(
                    f"a chain of 0 blocks plus {fresh} extra can never fit "
                    f"in a pool of {self._capacity}"
                )
            total += fresh
        hints: list[object] = []
        if after is not None:
            hints = after if type(after) is list else _as_list(after, "after")
            if len(hints) != len(wanted) or any(type(hint) is not int for hint in hints):
                raise InvalidArgumentError(f"after must be one int per count, got {after!r:.200}")
        return wanted, hints, total

    def _admit_each(
        self, wanted: list[object], hints: list[object], total: int, apart: bool
    ) -> tuple[list[int], list[list[int]]] | None:
        """`admit_each` after its checks: the ids as runs, and the removed hashes as
        descending runs, each admission's apart (``apart``) or all in one."""
        # Admissions only take: if all of them fit together, each one fits in its turn.
        if total - self._capacity + self._num_copies + self._reserved > self._num_inactive:
            return None  # refused whole: no admission was made, so none failed either
        ids: list[int] = []
        removed: list[list[int]] = [] if apart else [[]]
        tails: dict[int, int] = {}  # a table's last id before this call -> its last now
        free = self._capacity - self._num_copies - self._reserved
        for i in range(len(wanted)):
            fresh = cast(int, wanted[i])
            # `_pin_and_reserve` of no prefix, which fits: evict what free capacity lacks.
            evicted: list[int] = [] if apart else removed[0]
            if fresh > free:
                self._evict(fresh - free, evicted)
                self._evictions += fresh - free
                free = 0
            else:
                free -= fresh
            self._reserved += fresh
            self._reserves += 1
            if apart:
                removed.append(evicted)
            if fresh:
                table = cast(int, hints[i]) if hints else -1
                self._new_private(fresh, ids, tails.get(table, table))
                if table >= 0:
                    tails[table] = ids[-2] + ids[-1] - 1
        return ids, removed

    def activate_prefix(self, reservation: object) -> list[BlockId]:
        """Turn the reservation's prefix pins into request references, root first."""
        if type(reservation) is not Reservation or reservation._pool is not self:
            _foreign(reservation)
        prefix = reservation._prefix
        if not prefix:
            if reservation._closed:
                _closed(reservation)
            return []
        reservation._prefix = []
        reservation._prefix_len = 0
        for r in range(0, len(prefix), 2):
            for extent in self._carve(prefix[r], prefix[r + 1]):
                extent.holds += _PIN_TO_REF
                self._refs += extent.n
        return cast("list[BlockId]", _expand(prefix))

    def allocate_private(self, reservation: object) -> BlockId:
        """Spend one reserved unit on a new request-private copy."""
        if type(reservation) is not Reservation or reservation._pool is not self:
            _foreign(reservation)
        fresh = reservation._fresh
        if fresh <= 0:  # a cancelled reservation has none left either
            _exhausted(reservation)
        reservation._fresh = fresh - 1
        ids: list[int] = []
        self._new_private(1, ids, reservation._last)
        block_id = ids[0]
        reservation._last = block_id
        return BlockId(block_id)

    def allocate_cached(self, reservation: object, block_hash: object) -> tuple[BlockId, bool]:
        """Allocate straight into the cache; True iff the hash became visible (0 -> 1)."""
        if type(reservation) is not Reservation or reservation._pool is not self:
            _foreign(reservation)
        fresh = reservation._fresh
        if fresh <= 0:
            _exhausted(reservation)
        if not _is_hash(block_hash):
            _bad_hash(block_hash)
        reservation._fresh = fresh - 1
        ids: list[int] = []
        self._new_private(1, ids, reservation._last)  # then cached: the reference's order
        block_id = ids[0]
        reservation._last = block_id
        firsts: list[int] = []
        self._cache(self._live(block_id), cast(int, block_hash), firsts, 0)
        return BlockId(block_id), bool(firsts)

    def cache_private(self, block_id: object, block_hash: object) -> bool:
        """Make a private copy findable; True iff it is the hash's first resident copy."""
        extent = self._live(block_id)
        if extent.hash != PRIVATE:
            _already_cached(extent, cast(int, block_id))
        if not _is_hash(block_hash):
            _bad_hash(block_hash)
        firsts: list[int] = []
        self._cache(self._carve_one(extent, cast(int, block_id)), cast(int, block_hash), firsts, 0)
        return bool(firsts)

    def cache_many(self, pairs: object) -> list[bool]:
        """`cache_private` for each ``(block_id, hash)`` pair in order, all or nothing.

        Every pair is checked first (a live private copy, named once in the batch, and a
        valid hash), so a bad pair raises before anything changes. Returns the flags.
        """
        items = pairs if type(pairs) is list else _as_list(pairs)
        ids: list[object] = []
        hashes: list[object] = []
        seen: set[object] = set()
        for pair in items:
            if (type(pair) is not tuple and type(pair) is not list) or len(pair) != 2:
                raise InvalidArgumentError(f"expected a (block_id, hash) pair, got {pair!r}")
            self._claim(pair[0], pair[1], seen)
            ids.append(pair[0])
            hashes.append(pair[1])
        return _flags(self._cache_aligned(_runs_of(ids), _runs_of(hashes)), len(ids))

    def cache_chain(self, block_ids: object, hashes: object) -> list[bool]:
        """`cache_many` of the pairs ``zip(block_ids, hashes)``, given as two sequences of
        one length (a table's blocks and their hashes, with no pair built): all or
        nothing, the same checks in the same order, the same flags."""
        ids = block_ids if type(block_ids) is list else _as_list(block_ids, "block_ids")
        keys = hashes if type(hashes) is list else _as_list(hashes, "hashes")
        if len(ids) != len(keys):
            raise InvalidArgumentError(
                f"{len(ids)} block ids and {len(keys)} hashes: one hash per block"
            )
        return self._cache_pairs(ids, keys, len(ids))

    def cache_runs(self, block_ids: object, hashes: object) -> list[int]:
        """`cache_chain` of the ids and hashes ``block_ids`` and ``hashes`` hold (each
        runs of consecutive ints, flat ``first, count`` pairs, of one total length),
        its flags as runs: the positions of the blocks that are their hash's first
        resident copy."""
        ids, size = _checked_runs(block_ids, "block_ids")
        keys, length = _checked_runs(hashes, "hashes")
        if size != length:
            raise InvalidArgumentError(f"{size} block ids and {length} hashes: one hash per block")
        if overlapping(cast("list[int]", ids)):  # a block named twice: the pair checks say so
            self._claim_pairs(
                cast("list[object]", _expand(cast("list[int]", ids))),
                cast("list[object]", _expand(cast("list[int]", keys))),
                size,
            )
        self._check_private(ids)
        _check_hashes(keys, 0, length)
        return self._cache_aligned(ids, keys)

    def _cache_pairs(self, ids: list[object], hashes: list[object], size: int) -> list[bool]:
        """`cache_chain` of two lists of one length: each pair checked in order, then
        all cached."""
        self._claim_pairs(ids, hashes, size)
        return _flags(self._cache_aligned(_runs_of(ids), _runs_of(hashes)), size)

    def _claim_pairs(self, ids: list[object], hashes: list[object], size: int) -> None:
        """Each pair of two lists of one length checked in order (`_claim`)."""
        seen: set[object] = set()
        for i in range(size):
            self._claim(ids[i], hashes[i], seen)

    def _claim(self, block_id: object, block_hash: object, seen: set[object]) -> None:
        """A batch's check of one pair: a live private copy not named before in the batch
        (``seen``, which it joins), and a valid hash."""
        extent = self._live(block_id)
        if block_id in seen:
            raise AlreadyCachedError(f"block {block_id} appears twice in one batch")
        if extent.hash != PRIVATE:
            _already_cached(extent, cast(int, block_id))
        if not _is_hash(block_hash):
            _bad_hash(block_hash)
        seen.add(block_id)

    def release(self, block_id: object) -> None:
        """Drop one request reference: a private copy is freed, a cached one may go idle."""
        extent = self._live(block_id)
        if not extent.holds & REF_MASK:
            _not_referenced(extent, cast(int, block_id), 1)
        self._release(self._carve_one(extent, cast(int, block_id)))

    def release_many(self, block_ids: object) -> None:
        """`release` each id in the order given, all or nothing.

        Every id is checked first (live, holding at least as many references as it is
        named in the batch), so a bad id raises before anything changes. Callers pass a
        request's table reversed to release it leaf first.
        """
        ids = block_ids if type(block_ids) is list else _as_list(block_ids)
        runs = self._releasable(ids)
        for r in range(0, len(runs), 2):
            for extent in reversed(self._carve(runs[r] - runs[r + 1] + 1, runs[r + 1])):
                self._release(extent)

    def release_runs(self, block_ids: object) -> None:
        """`release_many` of a table given root first as runs of consecutive ids (flat
        ``first, count`` pairs): every id released, leaf first (the last one first)."""
        runs = self._table_runs(block_ids)
        for r in range(len(runs) - 2, -1, -2):
            for extent in reversed(self._carve(runs[r], runs[r + 1])):
                self._release(extent)

    def unadmit(self, block_ids: object) -> None:
        """Undo an `admit` whose result nobody used: `release_many` of its ids (pass them
        leaf first), except that a cached copy going idle returns to the LRU place it
        would hold had the admit never happened (by its stamp), not to the tail.

        Evictions the admit made stay made. Raises as `release_many`, changing nothing.
        """
        ids = block_ids if type(block_ids) is list else _as_list(block_ids)
        runs = self._releasable(ids)
        for r in range(0, len(runs), 2):
            for extent in reversed(self._carve(runs[r] - runs[r + 1] + 1, runs[r + 1])):
                self._unadmit(extent)

    def unadmit_runs(self, block_ids: object) -> None:
        """`unadmit` of a table's blocks given root first as runs (as `release_runs`)."""
        runs = self._table_runs(block_ids)
        for r in range(len(runs) - 2, -1, -2):
            for extent in reversed(self._carve(runs[r], runs[r + 1])):
                self._unadmit(extent)

    def _unadmit(self, extent: Extent) -> None:
        if extent.hash == PRIVATE:
            self._drop(extent)
            return
        extent.holds -= 1
        self._refs -= extent.n
        if not extent.holds:
            self._link_by_stamp(extent)

    def _releasable(self, ids: list[object]) -> list[int]:
        """The ids of a release, in their order, as descending runs (flat ``highest id,
        count`` pairs: ids ``high, high - 1, ...``), every id checked live and holding as
        many references as it is named; raises before anything changes."""
        runs: list[int] = []
        named: dict[int, int] = {}
        for block_id in ids:
            extent = self._live(block_id)
            number = cast(int, block_id)
            times = named.get(number, 0) + 1
            named[number] = times
            if extent.holds & REF_MASK < times:
                _not_referenced(extent, number, times)
            if runs and number == runs[-2] - runs[-1]:
                runs[-1] += 1
            else:
                runs.append(number)
                runs.append(1)
        return runs

    def _table_runs(self, block_ids: object) -> list[int]:
        """A table's checked runs of ids (`release_runs`), each id live and held."""
        runs, _ = _checked_runs(block_ids, "block_ids")
        if overlapping(cast("list[int]", runs)):
            # A table that names a block twice: the per-block checks count the names.
            self._releasable(cast("list[object]", _expand(cast("list[int]", runs))))
        for r in range(0, len(runs), 2):
            first = cast(int, runs[r])
            end = first + cast(int, runs[r + 1])
            while first < end:
                extent = self._live(first)
                if not extent.holds & REF_MASK:
                    _not_referenced(extent, first, 1)
                first = extent.id + extent.n
        return cast("list[int]", runs)

    def unallocate(self, block_id: object, reservation: object = None) -> None:
        """Undo an allocation: the copy leaves the pool as if it had never been allocated.

        The copy must hold nothing but the one reference its allocation gave it (refs 1,
        pins 0); a cached one leaves the prefix cache too (a duplicate's siblings keep
        its hash resident). Its unit goes back to ``reservation`` as a fresh unit when
        one is given and still open, else to free capacity. Raises UnknownBlockError,
        BlockNotReferencedError (an idle copy: nothing to undo), BlockSharedError,
        ForeignReservationError and ReservationClosedError.
        """
        extent = self._live(block_id)
        number = cast(int, block_id)
        if reservation is not None:
            if type(reservation) is not Reservation or reservation._pool is not self:
                _foreign(reservation)
            if reservation._closed:
                _closed(reservation)
        if not extent.holds:
            _not_referenced(extent, number, 1)
        if extent.holds != 1:
            raise BlockSharedError(
                f"block {number} is held by more than its allocation "
                f"(refs={extent.refs}, pins={extent.pins}); release it instead"
            )
        self._drop(self._carve(number, 1)[0])
        if reservation is not None:
            reservation._fresh += 1
            self._reserved += 1

    def cancel(self, reservation: object) -> None:
        """Return unconsumed capacity and unpin the unactivated prefix, leaf first."""
        self._cancel(reservation, False)

    def unreserve(self, reservation: object) -> None:
        """Undo a `reserve` whose result nobody used: `cancel` it, except that a prefix
        copy going idle returns to the LRU place it would hold had the reserve never
        happened (by its stamp), not to the tail. Evictions the reserve made stay made.
        Raises as `cancel`."""
        self._cancel(reservation, True)

    def _cancel(self, reservation: object, undo: bool) -> None:
        if type(reservation) is not Reservation or reservation._pool is not self:
            _foreign(reservation)
        if reservation._closed:
            _closed(reservation)
        reservation._closed = True
        prefix = reservation._prefix
        if prefix:
            reservation._prefix = []
            reservation._prefix_len = 0
            # Leaf first: a suffix becomes an older LRU candidate than its parent.
            for r in range(len(prefix) - 2, -1, -2):
                for extent in reversed(self._carve(prefix[r], prefix[r + 1])):
                    holds = extent.holds - PIN
                    extent.holds = holds
                    if undo:
                        if not holds:
                            self._link_by_stamp(extent)
                        continue
                    extent.stamp = self._clock + 1
                    self._clock += extent.n
                    if not holds:
                        self._link_tail(extent)
        fresh = reservation._fresh
        if fresh:
            self._reserved -= fresh
            reservation._fresh = 0

    # -------------------------------------------------------------- internals

    def _walk(self, runs: list[object], limit: int, pieces: list[int] | None) -> tuple[int, int]:
        """Walk the chain ``runs`` root first to its first miss, at most ``limit`` hashes:
        ``(hits, active)``; ``pieces``, if given, gets the hits' first copies' ids as
        runs. Raises `InvalidHashError` for a malformed hash up to the first miss."""
        hits = active = 0
        for r in range(0, len(runs), 2):
            if hits >= limit:
                break
            key = runs[r]
            left = cast(int, runs[r + 1])
            while left and hits < limit:
                found, span = self._first_span(key, min(left, limit - hits))
                if found is None:
                    return hits, active
                hits += span
                if found.holds:
                    active += span
                if pieces is not None:
                    _add_run(
                        pieces,
                        found.id + (0 if span == found.n else cast(int, key) - found.hash),
                        span,
                    )
                left -= span
                if left:
                    key = cast(int, key) + span
        return hits, active

    def _any_resident(self, runs: list[object]) -> bool:
        for r in range(0, len(runs), 2):
            key = runs[r]
            left = cast(int, runs[r + 1])
            while left:
                if not _is_hash(key):
                    _bad_hash(key)
                start = cast(int, key)
                if start.bit_length() > BOXED_BITS:
                    if start in self._buckets:
                        return True
                    left -= 1
                    if left:
                        key = start + 1
                    continue
                span = min(left, _BUCKET - (start & _BUCKET_MASK))
                entry = self._buckets.get(start >> _BUCKET_BITS)
                if entry is not None:
                    for extent in _extents(entry):
                        if extent.hash < start + span and start < extent.hash + extent.n:
                            return True
                key = start + span
                left -= span
        return False

    def _first_span(self, block_hash: object, want: int) -> tuple[Extent | None, int]:
        """The extent holding ``block_hash``'s first copy, and for how many hashes from
        it (at most ``want``, within the bucket) it holds their first copies too; (None,
        0) when it is not resident. Raises `InvalidHashError` for a malformed hash (a
        resident one was checked when cached, so a hit needs no check)."""
        if type(block_hash) is not int:
            _bad_hash(block_hash)
        key = block_hash
        if key.bit_length() > BOXED_BITS or key < 0:  # a bucket of its own
            alone = self._buckets.get(key)
            if alone is None:
                if not _is_hash(key):
                    _bad_hash(key)
                return None, 0
            return (alone if type(alone) is Extent else cast("list[Extent]", alone)[0]), 1
        entry = self._buckets.get(key >> _BUCKET_BITS)
        if entry is None:
            return None, 0
        span = min(want, _BUCKET - (key & _BUCKET_MASK))
        if type(entry) is Extent:  # the bucket's only extent: no earlier copy
            low = entry.hash
            if low <= key < low + entry.n:
                return entry, min(span, low + entry.n - key)
            return None, 0
        for extent in cast("list[Extent]", entry):
            low = extent.hash
            if low <= key:
                if key < low + extent.n:
                    return extent, min(span, low + extent.n - key)
            elif low < key + span:
                span = low - key  # an earlier copy of a later hash: first from there on
        return None, 0

    def _pin_and_reserve(
        self, pieces: list[int], hits: int, fresh: int, hold: int
    ) -> list[int] | None:
        """Hold (``hold``: a pin or a reference) the validated prefix copies ``pieces``
        (``hits`` of them) and reserve ``fresh`` units, evicting from the LRU head as
        needed; the removed hashes (as `_evict` gives them), or None (nothing changed) if
        even evicting every
        unpinned inactive copy would not make room."""
        needed = fresh - self._capacity + self._num_copies + self._reserved
        if needed > 0:
            evictable = self._num_inactive
            if needed > evictable - hits:
                # Inactive prefix copies get held first, so they are not evictable.
                evictable -= self._idle_among(pieces)
                if needed > evictable:
                    self._reserve_failures += 1
                    return None
        for r in range(0, len(pieces), 2):
            if pieces[r + 1] == 1:  # a copy of its own (a token hash's): no list
                extent = self._live(pieces[r])
                self._hold(extent if extent.n == 1 else self._carve_one(extent, pieces[r]), hold)
                continue
            for extent in self._carve(pieces[r], pieces[r + 1]):
                self._hold(extent, hold)
        if hold == 1:
            self._refs += hits
        removed: list[int] = []
        if needed > 0:
            self._evict(needed, removed)
            self._evictions += needed
        self._reserved += fresh
        self._reserves += 1
        return removed

    def _hold(self, extent: Extent, hold: int) -> None:
        """Add ``hold`` (a pin or a reference) to each copy of a carved extent; an idle
        one leaves the LRU first (membership follows refs and pins)."""
        if not extent.holds:
            self._unlink(extent)
            self._num_inactive -= extent.n
        extent.holds += hold

    def _idle_among(self, pieces: list[int]) -> int:
        """How many distinct copies the id runs ``pieces`` name are inactive."""
        spans = sorted((pieces[r], pieces[r] + pieces[r + 1]) for r in range(0, len(pieces), 2))
        idle = 0
        reached = -1
        for low, high in spans:
            position = max(low, reached)
            while position < high:
                extent = self._live(position)
                end = min(high, extent.id + extent.n)
                if not extent.holds:
                    idle += end - position
                position = end
            reached = max(reached, high)
        return idle

    def _new_private(self, fresh: int, ids: list[int], after: int = -1) -> None:
        """Spend ``fresh`` reserved units on private copies, each holding one reference;
        their ids join the runs ``ids``. They follow the id ``after`` in its page while
        its page has room and nobody took the ids after it (`_page_ends`), else go on
        pages of their own."""
        self._reserved -= fresh
        self._num_copies += fresh
        self._refs += fresh
        if fresh and after >= 0 and (after + 1) & _PAGE_MASK:
            page = (after >> _PAGE_BITS) & _SLOT_MASK
            if page < len(self._page_ends) and self._page_ends[page] == after + 1:
                n = min(fresh, _PAGE - ((after + 1) & _PAGE_MASK))
                self._place(Extent(after + 1, n, PRIVATE, 1, 0), page)
                self._page_used[page] += n
                self._page_ends[page] = after + 1 + n
                _add_run(ids, after + 1, n)
                fresh -= n
        while fresh:
            n = min(fresh, _PAGE)
            extent = Extent(0, n, PRIVATE, 1, 0)
            page = self._take_page(extent, 0)
            self._page_ends[page] = extent.id + n
            _add_run(ids, extent.id, n)
            fresh -= n

    def _new_cached(self, hashes: list[object], ids: list[int]) -> list[int]:
        """Spend a reserved unit on a cached copy of each of the checked hashes ``hashes``
        (runs), in order, each holding one reference; their ids join the runs ``ids``.
        Returns the positions of those that are their hash's first resident copy, as
        runs. A run of one bucket gets a page of its own at the hashes' offsets: one
        extent."""
        firsts: list[int] = []
        position = 0
        for r in range(0, len(hashes), 2):
            key = cast(int, hashes[r])
            left = cast(int, hashes[r + 1])
            while left:
                if key.bit_length() > BOXED_BITS:
                    n = 1
                    offset = 0
                else:
                    n = min(left, _BUCKET - (key & _BUCKET_MASK))
                    offset = key & _PAGE_MASK
                extent = Extent(0, n, PRIVATE, 1, 0)
                self._take_page(extent, offset)
                self._reserved -= n
                self._num_copies += n
                self._refs += n
                position = self._cache(extent, key, firsts, position)
                _add_run(ids, extent.id, n)
                left -= n
                if left:
                    key += n
        return firsts

    def _cache_aligned(self, ids: list[object], hashes: list[object]) -> list[int]:
        """Cache the checked private copies ``ids`` under ``hashes`` (runs of one total
        length), pair by pair in order; the positions of those that are their hash's
        first resident copy, as runs."""
        firsts: list[int] = []
        position = 0
        h = 0
        key = 0
        left_keys = 0
        for r in range(0, len(ids), 2):
            first = cast(int, ids[r])
            left = cast(int, ids[r + 1])
            while left:
                if not left_keys:
                    key = cast(int, hashes[h])
                    left_keys = cast(int, hashes[h + 1])
                    h += 2
                n = min(left, left_keys)
                for extent in self._carve(first, n):
                    size = extent.n  # `_cache` may split it at a bucket's end
                    position = self._cache(extent, key, firsts, position)
                    left_keys -= size
                    if left_keys:  # no addition past a run's last hash (a token hash's)
                        key += size
                first += n
                left -= n
        return firsts

    def _cache(self, extent: Extent, key: int, firsts: list[int], position: int) -> int:
        """Make the private ``extent`` (carved: no other copy in it) findable under the
        hashes from ``key`` on, split at bucket ends. Its copies are a call's from
        ``position`` on: ``firsts`` (runs of positions) gets those that are their hash's
        first resident copy. Returns the position after them."""
        while True:
            if key.bit_length() > BOXED_BITS:
                rest = self._split(extent, 1) if extent.n > 1 else None
                alone = self._buckets.get(key)
                if alone is None:
                    _add_run(firsts, position, 1)
                position += 1
                if alone is None:
                    self._buckets[key] = extent
                elif type(alone) is Extent:
                    self._buckets[key] = [alone, extent]
                else:
                    cast("list[Extent]", alone).append(extent)
                extent.hash = key
                if rest is None:
                    return position
                key += 1
                extent = rest
                continue
            room = _BUCKET - (key & _BUCKET_MASK)
            rest = self._split(extent, room) if extent.n > room else None
            bucket_key = key >> _BUCKET_BITS
            entry = self._buckets.get(bucket_key)
            if entry is None:
                self._buckets[bucket_key] = extent
                _add_run(firsts, position, extent.n)
            else:
                end = key + extent.n
                others = _extents(entry)
                overlap = False
                for other in others:
                    if other.hash < end and key < other.hash + other.n:
                        overlap = True
                        break
                if not overlap:
                    _add_run(firsts, position, extent.n)
                    lower = self._lower_twin(extent, key)
                    if lower is not None:
                        # what `_merge_down` would make of it once bucketed: its hashes are
                        # no other copy's, so it joins the extent below without a bucket
                        # entry put in and taken out again
                        n = extent.n
                        self._join_below(lower, extent)
                        position += n
                        if rest is None:
                            return position
                        key += n
                        extent = rest
                        continue
                else:
                    for k in range(key, end):
                        if not any(o.hash <= k < o.hash + o.n for o in others):
                            _add_run(firsts, position + k - key, 1)
                if type(entry) is Extent:
                    self._buckets[bucket_key] = [entry, extent]
                else:
                    cast("list[Extent]", entry).append(extent)
            extent.hash = key
            position += extent.n
            self._merge_down(extent)
            if rest is None:
                return position
            key += extent.n
            extent = rest

    def _lower_twin(self, extent: Extent, key: int) -> Extent | None:
        """The extent just below the held ``extent`` in its page when the two are alike
        and would continue each other once ``extent`` is cached under the hashes from
        ``key`` (not boxed; one bucket, never let go of); else None. `_merge_down`'s
        conditions but one: that no other copy holds those hashes."""
        if not extent.holds or extent.stamp or not key & _BUCKET_MASK:
            return None
        offset = extent.id & _PAGE_MASK
        if not offset:
            return None
        entries = cast("list[Extent | None]", self._pages[(extent.id >> _PAGE_BITS) & _SLOT_MASK])
        lower = entries[offset - 1]
        if (
            lower is not None
            and lower.hash + lower.n == key
            and lower.hash != PRIVATE
            and lower.holds == extent.holds
            and not lower.stamp
        ):
            return lower
        return None

    def _join_below(self, lower: Extent, extent: Extent) -> None:
        """``extent``'s ids become ``lower``'s, which they continue: one extent."""
        entries = cast("list[Extent | None]", self._pages[(extent.id >> _PAGE_BITS) & _SLOT_MASK])
        offset = extent.id & _PAGE_MASK
        for i in range(offset, offset + extent.n):
            entries[i] = lower
        lower.n += extent.n

    def _merge_down(self, extent: Extent) -> None:
        """Merge a just cached, held ``extent`` into the extent before it in its page when
        the two are alike and continue each other (`_lower_twin`) and no other copy holds
        its hashes: a table cached block by block (a decode) stays one extent."""
        if extent.hash.bit_length() > BOXED_BITS:
            return
        lower = self._lower_twin(extent, extent.hash)
        if lower is not None and self._alone_in(extent):
            self._unbucket(extent)
            self._join_below(lower, extent)

    def _release(self, extent: Extent) -> None:
        """Drop one reference of each copy of a carved extent, released as one run leaf
        first (a private copy holds exactly one, and leaves the pool)."""
        if extent.hash == PRIVATE:
            self._drop(extent)
            return
        holds = extent.holds - 1
        extent.holds = holds
        self._refs -= extent.n
        extent.stamp = self._clock + 1
        self._clock += extent.n
        if not holds:
            self._link_tail(extent)

    def _link_tail(self, extent: Extent) -> None:
        """Link an idle extent at the LRU tail (stamped after every linked one), merged
        into the tail when it continues it (its lower neighbour, let go of next)."""
        sentinel = self._lru
        tail = cast(Extent, sentinel.prev)
        self._num_inactive += extent.n
        if (
            tail.id == extent.id + extent.n
            and extent.hash.bit_length() <= BOXED_BITS
            and tail.hash == extent.hash + extent.n
            and tail.stamp + tail.n == extent.stamp
            and tail.id & _PAGE_MASK
            and tail.hash & _BUCKET_MASK
            and self._alone_in(tail)
        ):
            # One extent again: ids, hashes and stamps all continue across the seam.
            self._unlink(tail)
            self._unbucket(tail)
            extent.n += tail.n
            extent.stamp = tail.stamp
            self._place(extent, (extent.id >> _PAGE_BITS) & _SLOT_MASK)
            tail = cast(Extent, sentinel.prev)
        tail.next = extent
        extent.prev = tail
        extent.next = sentinel
        sentinel.prev = extent

    def _alone_in(self, extent: Extent) -> bool:
        """Whether no other extent of its bucket holds any of its hashes."""
        low = extent.hash
        entry = self._buckets[_bucket_key(low)]
        if type(entry) is Extent:
            return True  # the bucket's only extent (this one)
        if low.bit_length() > BOXED_BITS:
            return False  # every extent of its bucket holds its one hash
        high = low + extent.n
        for other in cast("list[Extent]", entry):
            if other is not extent and other.hash < high and low < other.hash + other.n:
                return False
        return True

    def _link_by_stamp(self, extent: Extent) -> None:
        """Link an idle extent into the LRU at its stamp's place (from the tail back: an
        undo follows its call closely, so the place is near the tail)."""
        sentinel = self._lru
        node = cast(Extent, sentinel.prev)
        stamp = extent.stamp
        while node is not sentinel and node.stamp > stamp:
            node = cast(Extent, node.prev)
        following = cast(Extent, node.next)
        node.next = extent
        extent.prev = node
        extent.next = following
        following.prev = extent
        self._num_inactive += extent.n

    def _unlink(self, extent: Extent) -> None:
        previous = cast(Extent, extent.prev)
        following = cast(Extent, extent.next)
        previous.next = following
        following.prev = previous
        extent.prev = extent.next = None

    def _evict(self, count: int, removed: list[int]) -> None:
        """Evict ``count`` copies from the LRU head, each extent's last copies first; a
        hash is removed on its last copy: ``removed`` gets those hashes, in eviction
        order, as descending runs (`kvpool.pool.runs.add_descent`)."""
        sentinel = self._lru
        while count:
            extent = cast(Extent, sentinel.next)  # count <= inactive: never the sentinel
            n = extent.n
            taken = n if n <= count else count
            if extent.hash.bit_length() > BOXED_BITS:  # it holds one copy, its bucket's only hash
                key = extent.hash
                if type(self._buckets[key]) is Extent:  # the last copy: the hash goes
                    del self._buckets[key]
                    removed.append(key)  # no merge: no arithmetic on the hash
                    removed.append(1)
                else:
                    self._unbucket(extent)
                count -= 1
                self._num_copies -= 1
                self._num_inactive -= 1
                self._unlink(extent)
                self._clear(extent.id, 1)
                continue
            top = extent.hash + n - 1
            entry = self._buckets[extent.hash >> _BUCKET_BITS]
            if type(entry) is Extent:  # no other copy in the bucket
                add_descent(removed, top, taken)
            else:
                bucket = cast("list[Extent]", entry)
                for key in range(top, top - taken, -1):
                    if not any(
                        other is not extent and other.hash <= key < other.hash + other.n
                        for other in bucket
                    ):
                        add_descent(removed, key, 1)
            count -= taken
            self._num_copies -= taken
            self._num_inactive -= taken
            if taken < n:
                extent.n = n - taken
                if extent.stamp:
                    extent.stamp += taken
                self._clear(extent.id + extent.n, taken)
                break
            self._unlink(extent)
            self._forget(extent)

    def _drop(self, extent: Extent) -> None:
        """A carved extent of copies that each hold one reference leaves the pool."""
        self._forget(extent)
        self._num_copies -= extent.n
        self._refs -= extent.n

    def _forget(self, extent: Extent) -> None:
        """Take a dead extent out of its page and bucket."""
        self._clear(extent.id, extent.n)
        if extent.hash != PRIVATE:
            self._unbucket(extent)

    def _clear(self, first: int, n: int) -> None:
        """The ``n`` ids from ``first`` (one page's) are no longer live; a page left with
        no live copy frees its slot."""
        page = (first >> _PAGE_BITS) & _SLOT_MASK
        used = self._page_used[page] - n
        if not used:
            self._pages[page] = None
            self._page_ends[page] = -1
            self._free_pages.append(page)
        else:
            entries = cast("list[Extent | None]", self._pages[page])
            offset = first & _PAGE_MASK
            for i in range(offset, offset + n):
                entries[i] = None
        self._page_used[page] = used

    def _unbucket(self, extent: Extent) -> None:
        """Take a cached extent out of its bucket."""
        bucket_key = _bucket_key(extent.hash)
        entry = self._buckets[bucket_key]
        if type(entry) is Extent:
            del self._buckets[bucket_key]
        else:
            bucket = cast("list[Extent]", entry)
            bucket.remove(extent)
            if len(bucket) == 1:
                self._buckets[bucket_key] = bucket[0]

    def _place(self, extent: Extent, page: int) -> None:
        """Point the page's offsets of ``extent``'s ids at it."""
        entries = cast("list[Extent | None]", self._pages[page])
        offset = extent.id & _PAGE_MASK
        for i in range(offset, offset + extent.n):
            entries[i] = extent

    def _live(self, block_id: object) -> Extent:
        """The extent holding the live copy ``block_id``, or `UnknownBlockError`."""
        if type(block_id) is not int:
            _unknown(block_id)
        page = (block_id >> _PAGE_BITS) & _SLOT_MASK
        if page < len(self._pages):
            entries = self._pages[page]
            if entries is not None:
                extent = entries[block_id & _PAGE_MASK]
                # A reused slot's extent has another serial: it does not hold the id.
                if extent is not None and extent.id <= block_id < extent.id + extent.n:
                    return extent
        _unknown(block_id)

    def _check_private(self, ids: list[object]) -> None:
        """Every id of the runs ``ids`` is a live private copy (`cache_runs`)."""
        for r in range(0, len(ids), 2):
            first = cast(int, ids[r])
            end = first + cast(int, ids[r + 1])
            while first < end:
                extent = self._live(first)
                if extent.hash != PRIVATE:
                    _already_cached(extent, first)
                first = extent.id + extent.n

    def _carve(self, first: int, n: int) -> list[Extent]:
        """The extents that hold exactly the live ids ``[first, first + n)``, in id
        order, split where the range ends inside one."""
        extents: list[Extent] = []
        end = first + n
        while first < end:
            extent = self._live(first)
            if extent.id < first:
                extent = self._split(extent, first - extent.id)
            if extent.id + extent.n > end:
                self._split(extent, end - extent.id)
            extents.append(extent)
            first += extent.n
        return extents

    def _carve_one(self, extent: Extent, block_id: int) -> Extent:
        """The live ``extent``'s copy ``block_id`` as an extent of its own (`_carve` of
        one id)."""
        if extent.id < block_id:
            extent = self._split(extent, block_id - extent.id)
        if extent.n > 1:
            self._split(extent, 1)
        return extent

    def _split(self, extent: Extent, at: int) -> Extent:
        """Split ``extent`` after its first ``at`` copies (``0 < at < n``); return the
        part after them, which takes its place next to it in every index."""
        n = extent.n
        hashed = extent.hash != PRIVATE
        upper = Extent(
            extent.id + at, n - at, extent.hash + at if hashed else PRIVATE, extent.holds, 0
        )
        if extent.stamp:
            upper.stamp = extent.stamp  # the last copies hold the lowest stamps
            extent.stamp += n - at
        extent.n = at
        self._place(upper, (upper.id >> _PAGE_BITS) & _SLOT_MASK)
        if hashed:
            bucket_key = extent.hash >> _BUCKET_BITS  # split: a run of small hashes
            entry = self._buckets[bucket_key]
            if type(entry) is Extent:
                self._buckets[bucket_key] = [entry, upper]
            else:
                bucket = cast("list[Extent]", entry)
                bucket.insert(bucket.index(extent) + 1, upper)
        previous = extent.prev
        if previous is not None:  # linked: the upper part is evicted first
            previous.next = upper
            upper.prev = previous
            upper.next = extent
            extent.prev = upper
        return upper

    def _take_page(self, extent: Extent, offset: int) -> int:
        """Put the new ``extent`` on a page of its own at ``offset`` (its ids set: a free
        slot, a serial never used); return the page's slot."""
        serial = self._next_serial
        if serial >= self._serial_limit:
            serial = next(_serial_ranges) * _SERIALS_PER_RANGE
            self._serial_limit = serial + _SERIALS_PER_RANGE
        self._next_serial = serial + 1
        entries: list[Extent | None] = [None] * _PAGE
        pages = self._pages
        if self._free_pages:
            page = self._free_pages.pop()
            pages[page] = entries
            self._page_used[page] = extent.n
        else:
            page = len(pages)
            pages.append(entries)
            self._page_ends.append(-1)
            self._page_used.append(extent.n)
        extent.id = serial << _SERIAL_SHIFT | page << _PAGE_BITS | offset
        for i in range(offset, offset + extent.n):
            entries[i] = extent
        return page

    # ------------------------------------------------------------ debug views

    def _extents(self) -> list[Extent]:
        """Every live extent, once, by page and offset."""
        extents: list[Extent] = []
        for entries in self._pages:
            last: Extent | None = None
            for extent in entries or ():
                if extent is not None and extent is not last:
                    extents.append(extent)
                    last = extent
        return extents

    def debug_copies(self) -> list[tuple[int, int | None, int, int]]:
        """Every live copy as ``(id, hash or None, refs, pins)``, in id order: for tests
        that compare states copy by copy (not part of the semantics' API)."""
        copies: list[tuple[int, int | None, int, int]] = []
        for extent in self._extents():
            for i in range(extent.n):
                hashed = None if extent.hash == PRIVATE else extent.hash + i
                copies.append((extent.id + i, hashed, extent.refs, extent.pins))
        return sorted(copies)

    def debug_lru(self) -> list[BlockId]:
        """The inactive LRU's copies, head (evicted first) to tail: for tests (the
        public API shows this order only through later evictions)."""
        ids: list[int] = []
        sentinel = self._lru
        node = cast(Extent, sentinel.next)
        while node is not sentinel:
            ids.extend(range(node.id + node.n - 1, node.id - 1, -1))
            node = cast(Extent, node.next)
        return cast("list[BlockId]", ids)

    def debug_index(self) -> dict[int, list[BlockId]]:
        """Each resident hash's copies, first copy first: for tests."""
        index: dict[int, list[int]] = {}
        for entry in self._buckets.values():
            for extent in _extents(entry):
                for i in range(extent.n):
                    index.setdefault(extent.hash + i, []).append(extent.id + i)
        return cast("dict[int, list[BlockId]]", {h: index[h] for h in sorted(index)})

    # ------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Re-derive all state from scratch; raise `InvariantViolationError` on any breach.

        The reference's LRU consistency check, plus: every extent sits in its page and,
        cached, its bucket exactly once and within them, no index entry is empty,
        counters match, copies + reserved <= capacity.
        """
        live: dict[int, Extent] = {}  # id(extent) -> extent
        copies = 0
        refs = 0
        free = set(self._free_pages)
        _require(len(free) == len(self._free_pages), "a free page slot is listed twice")
        _require(
            len(self._page_ends) == len(self._pages) == len(self._page_used),
            "page ends or counts do not match the pages",
        )
        for page in range(len(self._pages)):
            entries = self._pages[page]
            if entries is None:
                _require(page in free, f"page slot {page} is neither used nor free")
                continue
            _require(page not in free, f"page slot {page} is both used and free")
            _require(len(entries) == _PAGE, f"page {page} does not have {_PAGE} offsets")
            used = 0
            base = -1
            offset = 0
            while offset < _PAGE:
                extent = entries[offset]
                if extent is None:
                    offset += 1
                    continue
                _require(extent.n >= 1, f"extent at {extent.id} holds no copy")
                if base < 0:
                    base = extent.id >> _PAGE_BITS
                _require(
                    extent.id >> _PAGE_BITS == base
                    and base & _SLOT_MASK == page
                    and extent.id & _PAGE_MASK == offset
                    and offset + extent.n <= _PAGE,
                    f"extent at {extent.id} is not where page {page} has it",
                )
                for i in range(offset, offset + extent.n):
                    _require(entries[i] is extent, f"page {page} misplaces extent {extent.id}")
                _require(id(extent) not in live, f"extent at {extent.id} sits twice")
                live[id(extent)] = extent
                used += extent.n
                copies += extent.n
                _require(extent.holds >= 0, f"extent at {extent.id} has a negative count")
                refs += extent.refs * extent.n
                offset += extent.n
            _require(used > 0, f"page {page} has no copy")
            _require(used == self._page_used[page], f"page {page} miscounts its copies")
        _require(copies == self._num_copies, "live copy count does not match its counter")
        _require(self._reserved >= 0, "reserved capacity is negative")
        _require(
            self._num_copies + self._reserved <= self._capacity,
            "block-pool occupancy exceeds capacity",
        )
        _require(refs == self._refs, "request reference count does not match its counter")
        for page, end in enumerate(self._page_ends):
            entries = self._pages[page]
            if end < 0:
                continue
            _require(entries is not None, f"page {page} has an end but no extent")
            assert entries is not None
            last = max(e.id + e.n for e in entries if e is not None)
            _require(
                last <= end and (end - 1) >> _PAGE_BITS == (last - 1) >> _PAGE_BITS,
                f"page {page} handed out ids past its end",
            )

        # The reference's assert_lru_consistent, on the circular list.
        sentinel = self._lru
        linked: set[int] = set()
        inactive = 0
        previous = sentinel
        cursor = sentinel.next
        while cursor is not sentinel:
            _require(cursor is not None, "inactive LRU is broken (a missing link)")
            assert cursor is not None
            _require(id(cursor) not in linked, "inactive LRU contains a cycle")
            linked.add(id(cursor))
            _require(live.get(id(cursor)) is cursor, "inactive LRU points to a missing copy")
            _require(cursor.hash != PRIVATE, "inactive LRU contains a private copy")
            _require(cursor.holds == 0, "active copy is linked into the inactive LRU")
            _require(cursor.prev is previous, "inactive LRU contains a broken back-pointer")
            # Stamps rise along the LRU; never let-go-of copies (stamp 0) lead it.
            newest = previous.stamp + previous.n - 1 if previous.stamp else 0
            _require(
                previous is sentinel
                or newest < cursor.stamp
                or (not cursor.stamp and not previous.stamp),
                "inactive LRU is out of stamp order",
            )
            inactive += cursor.n
            previous = cursor
            cursor = cursor.next
        _require(sentinel.prev is previous, "inactive LRU tail does not match its last copy")
        _require(
            inactive == self._num_inactive,
            "inactive LRU length does not match its reachable copies",
        )

        indexed: set[int] = set()
        for bucket_key, entry in self._buckets.items():
            bucket = _extents(entry)
            _require(
                type(entry) is Extent or len(bucket) >= 2,
                f"hash bucket {bucket_key} lists fewer than two extents",
            )
            for extent in bucket:
                _require(live.get(id(extent)) is extent, f"bucket {bucket_key} holds a dead copy")
                _require(
                    (extent.hash + extent.n - 1) >> _BUCKET_BITS == bucket_key
                    if extent.hash.bit_length() <= BOXED_BITS
                    else extent.hash == bucket_key and extent.n == 1,
                    f"extent at {extent.id} is not within its bucket {bucket_key}",
                )
                _require(id(extent) not in indexed, f"extent at {extent.id} is indexed twice")
                indexed.add(id(extent))
        for extent in live.values():
            if extent.hash == PRIVATE:
                _require(
                    extent.holds == 1,
                    f"private copy {extent.id} must hold one reference and no pin",
                )
                _require(id(extent) not in linked, "private copy is in the inactive LRU")
            else:
                _require(id(extent) in indexed, f"copy {extent.id} is not indexed")
                _require(
                    (id(extent) in linked) == (extent.holds == 0),
                    "cached copy membership disagrees with its refs and pins",
                )
                if extent.holds:
                    _require(
                        extent.prev is None and extent.next is None,
                        "active cached copy retains inactive LRU links",
                    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolationError(message)


def _bad_hash(value: object) -> NoReturn:
    raise InvalidHashError(f"block hash must be an int in [0, 2**64), got {value!r}")


def _unknown(block_id: object) -> NoReturn:
    raise UnknownBlockError(
        f"block id {block_id!r} names no live copy of this pool "
        "(released, evicted, never allocated, or from another pool)"
    )


def _already_cached(extent: Extent, block_id: int) -> NoReturn:
    raise AlreadyCachedError(
        f"block {block_id} is already cached (hash {extent.hash + block_id - extent.id}); "
        "only a private copy can enter the prefix cache"
    )


def _not_referenced(extent: Extent, block_id: int, count: int) -> NoReturn:
    refs = extent.holds & REF_MASK
    if count == 1:
        hashed = None if extent.hash == PRIVATE else extent.hash + block_id - extent.id
        raise BlockNotReferencedError(
            f"block {block_id} (hash {hashed}) holds no request reference to release"
        )
    raise BlockNotReferencedError(
        f"block {block_id} is released {count} times but holds {refs} request reference(s)"
    )


def _foreign(reservation: object) -> NoReturn:
    if isinstance(reservation, Reservation):
        raise ForeignReservationError(f"{reservation!r} belongs to another pool")
    raise ForeignReservationError(f"expected a Reservation, got {reservation!r}")


def _closed(reservation: Reservation) -> NoReturn:
    raise ReservationClosedError(f"{reservation!r} was already cancelled")


def _exhausted(reservation: Reservation) -> NoReturn:
    if reservation._closed:
        _closed(reservation)
    raise ReservationExhaustedError(f"{reservation!r} has no fresh capacity left to allocate")


def _is_hash(value: object) -> bool:
    """An int in [0, 2**64). A function, so callers keep the caller's int object as is."""
    if type(value) is not int:
        return False
    bits = value.bit_length()
    if bits <= BOXED_BITS:
        return value >= 0  # compiled: a machine word's comparison
    return bits <= 64 and value > 0


def _check_limit(limit: object, size: int) -> int:
    """A walk's ``limit`` (None: ``size``), or `InvalidArgumentError`."""
    if limit is None:
        return size
    if type(limit) is not int or limit < 0:
        raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}")
    return limit


def _runs_of(items: list[object]) -> list[object]:
    """``items`` as runs (flat ``first, count`` pairs) of consecutive ints; an item that
    is not an int is a run of its own, for the caller's checks to name."""
    runs: list[object] = []
    size = len(items)
    i = 0
    while i < size:
        first = items[i]
        n = 1
        if type(first) is int and first.bit_length() <= BOXED_BITS:  # no arithmetic on a big one
            while i + n < size:
                item = items[i + n]
                if type(item) is not int or item != first + n:
                    break
                n += 1
        runs.append(first)
        runs.append(n)
        i += n
    return runs


def _checked_runs(runs: object, name: str) -> tuple[list[object], int]:
    """A caller's runs (a list of ``first, count`` pairs of ints, each count >= 0) and
    how many ints they hold, or `InvalidArgumentError` naming ``name``. Whether the ints
    are hashes or live ids is checked where they are read."""
    if type(runs) is not list or len(runs) % 2:
        raise InvalidArgumentError(
            f"{name} must be a list of (first, count) pairs, flat, got {runs!r:.200}"
        )
    items: list[object] = runs
    size = 0
    for r in range(0, len(items), 2):
        first = items[r]
        n = items[r + 1]
        if type(first) is not int:
            raise InvalidArgumentError(f"{name}: a run's first must be an int, got {first!r}")
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"{name}: a run's count must be an int >= 0, got {n!r}")
        size += n
    return items, size


def _check_hashes(runs: list[object], start: int, stop: int) -> None:
    """Raise `InvalidHashError` for the first malformed hash among positions ``[start,
    stop)`` of the chain ``runs``."""
    position = 0
    for r in range(0, len(runs), 2):
        if position >= stop:
            return
        n = cast(int, runs[r + 1])
        if n and position + n > start:
            first = runs[r]
            if not _is_hash(first):
                _bad_hash(first)
            beyond = min(position + n, stop) - 1 - position  # the run's last read hash
            if beyond and cast(int, first) + beyond > MAX_HASH:  # (no addition for one)
                _bad_hash(max(MAX_HASH + 1, cast(int, first) + start - position))
        position += n


def _bucket_key(block_hash: int) -> int:
    """The bucket of a cached hash: ``hash >> 6``, or a hash above ``2**62 - 1`` itself
    (module docstring)."""
    if block_hash.bit_length() > BOXED_BITS:
        return block_hash
    return block_hash >> _BUCKET_BITS


def _extents(entry: Extent | list[Extent]) -> list[Extent]:
    """A bucket's extents, in caching order, as a list (a one-extent bucket holds the
    extent itself: a one-item list is built for it)."""
    if type(entry) is Extent:
        return [entry]
    return cast("list[Extent]", entry)


def _flags(firsts: list[int], count: int) -> list[bool]:
    """The runs of positions ``firsts`` as ``count`` flags: a per-block call's answer."""
    flags = [False] * count
    for r in range(0, len(firsts), 2):
        for position in range(firsts[r], firsts[r] + firsts[r + 1]):
            flags[position] = True
    return flags
