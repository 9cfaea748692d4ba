"""The synchronous, I/O-free block pool: the reference's semantics, validated and fast.

Storage mirrors the reference's ``SlotMap``: ``_slots[slot]`` holds the live copy of a
slot, and a ``BlockId`` is ``serial << 32 | slot`` with a process-wide serial, so an id
is never reused and an id from another pool never names a copy here. ``_by_hash`` maps a
hash to its first resident copy and ``_dups`` to the later ones, in insertion order.
The inactive LRU is intrusive and circular around a sentinel: ``sentinel.next`` is the
head (evicted first), ``sentinel.prev`` the tail (released last).

Every public method validates all of its arguments before it changes anything, so a
`PoolError` leaves the pool exactly as it was: ``_resident`` and ``_live`` check a hash
or an id, ``_cache`` and ``_release`` then act on a copy already checked (the batch
calls check every item before acting on any). ``check_invariants`` re-derives everything
from scratch to catch any slip.

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
    PoolError,
    PrefixNotResidentError,
    ReservationClosedError,
    ReservationExhaustedError,
    UnknownBlockError,
)
from kvpool.pool.copy import PIN, REF_MASK, Copy
from kvpool.pool.items import as_list as _as_list
from kvpool.pool.types import (
    ACTIVE_HIT,
    INACTIVE_HIT,
    MAX_HASH,
    Admission,
    BlockId,
    PrefixHit,
    Reservation,
    ReserveOutcome,
)

_SLOT_BITS: Final = 32
_SLOT_MASK: Final = (1 << _SLOT_BITS) - 1
_MAX_CAPACITY: Final = 1 << _SLOT_BITS
_ID_STEP: Final = 1 << _SLOT_BITS
_IDS_PER_RANGE: Final = 1 << 12
# Pools claim ranges of serials from one process-wide counter, so an id is unique across
# every pool in the process and the hot path needs no global state.
_id_ranges = count(1)
_PIN_TO_REF: Final = 1 - PIN  # added to ``holds``: one pin becomes one reference
_MAX_UNBOXED: Final = (1 << 62) - 1  # the largest int mypyc keeps as a machine word
_CLAIMED: Final = object()  # cache_many's mark on a copy it has checked, until it acts
_NO_HITS: Final[list[Copy]] = []  # never changed: the prefix of an admission of no chain


class BlockPool:
    """vLLM's GPU block pool: copies, refcounts, pins, an inactive LRU, reservations.

    Not thread-safe; one owner (a thread or the pool actor) drives it.
    """

    __slots__ = (
        "_by_hash",
        "_capacity",
        "_clock",
        "_dups",
        "_evictions",
        "_free",
        "_id_limit",
        "_lru",
        "_next_id",
        "_num_copies",
        "_num_inactive",
        "_refs",
        "_reserve_failures",
        "_reserved",
        "_reserves",
        "_slots",
    )

    def __init__(self, capacity: object) -> None:
        # Set before anything can raise: __del__ reads these two.
        # The slots grow with use up to `capacity` (copies never outnumber it): memory
        # follows the blocks in use, not the capacity asked for.
        self._slots: list[Copy | None] = []
        sentinel = Copy(-1, None, -1)  # never inactive, never evicted
        sentinel.prev = sentinel.next = sentinel
        self._lru = sentinel
        if type(capacity) is not int or not 1 <= capacity < _MAX_CAPACITY:
            raise InvalidArgumentError(f"capacity must be an int in [1, 2**32), got {capacity!r}")
        self._capacity: int = capacity
        # The copies that left the pool, each still naming its empty slot (``id &
        # _SLOT_MASK``), reused LIFO: a new copy takes one over with a fresh id, so a
        # block costs no allocation once the pool has held as many at once.
        self._free: list[Copy] = []
        # Hashes travel as the caller's int objects (typed object): narrowing one to int
        # would make the compiled code unbox it and box a fresh copy for every store.
        self._by_hash: dict[object, Copy] = {}
        self._dups: dict[object, list[Copy]] = {}  # never holds an empty list
        self._num_copies = 0
        self._num_inactive = 0
        self._clock = 0  # stamps copies as requests let go of them (Copy.stamp)
        self._reserved = 0
        self._refs = 0  # request references: one per private copy plus cached refs
        # Cumulative counters (kvpool's one source of them; see `reserves`).
        self._reserves = 0
        self._reserve_failures = 0
        self._evictions = 0
        self._id_limit = 0
        self._next_id = self._take_ids()  # ids are (serial << 32 | slot); serials only grow

    def __del__(self) -> None:
        # Compiled copies are invisible to the cyclic collector (see Copy), so the
        # LRU ring is unlinked by hand; bounded, in case a test corrupted the links.
        sentinel = self._lru
        node = sentinel.next
        for _ in range(len(self._slots) + 1):
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
        copy = self._resident(block_hash)
        if copy is None:
            return None
        return ACTIVE_HIT if copy.holds else INACTIVE_HIT

    def match_prefix(self, hashes: object, limit: object = None) -> tuple[int, int]:
        """Walk ``hashes`` root first until the first miss (at most ``limit`` of them).

        Returns ``(hits, active)``: how many leading hashes are resident and how many of
        those have an active first copy; the answers of one `prefix_hit` per hash, in
        one call. Raises `InvalidHashError` for a malformed hash before the first miss.
        """
        hashes = hashes if type(hashes) is list else _as_list(hashes)
        if limit is None:
            limit = len(hashes)
        elif type(limit) is not int or limit < 0:
            raise InvalidArgumentError(f"limit must be an int >= 0 or None, got {limit!r}")
        hits = active = 0
        for block_hash in hashes:
            if hits >= limit:
                break
            copy = self._resident(block_hash)
            if copy is None:
                break
            hits += 1
            if copy.holds:
                active += 1
        return hits, active

    def any_resident(self, hashes: object) -> bool:
        """Whether any of ``hashes`` has a resident copy: `prefix_hit` of each, in one call.

        Raises `InvalidHashError` for a malformed hash among those read before a resident one.
        """
        keys = hashes if type(hashes) is list else _as_list(hashes)
        return any(self._resident(block_hash) is not None for block_hash in keys)

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
        hits: list[Copy] = []
        for block_hash in hashes:
            copy = self._resident(block_hash)
            if copy is None:
                raise PrefixNotResidentError(
                    f"prefix hash {block_hash} is not resident; look a prefix up with "
                    "prefix_hit in the same turn as its reserve"
                )
            hits.append(copy)

        removed = self._pin_and_reserve(hits, fresh)
        if removed is None:
            return None
        return ReserveOutcome(Reservation(self, hits, fresh), cast("list[int]", removed))

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
        size = len(hashes)
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
        hits: list[Copy] = []
        active = 0
        for index in range(walk):
            copy = self._resident(hashes[index])
            if copy is None:
                break
            hits.append(copy)
            if copy.holds:
                active += 1
        if wanted < 0:
            # _resident checked the hashes up to the first miss, the miss included.
            for index in range(len(hits) + 1, size):
                if not _is_hash(hashes[index]):
                    _bad_hash(hashes[index])
            if type(extra) is not int or extra < 0:
                raise InvalidArgumentError(f"extra must be an int >= 0, got {extra!r}")
            if size + extra > self._capacity:
                raise CapacityError(
                    f"a chain of {size} blocks plus {extra} extra can never fit "
                    f"in a pool of {self._capacity}"
                )
            fresh = size - len(hits) + extra
        else:
            if wanted > self._capacity:
                raise CapacityError(f"{wanted} blocks can never fit in a pool of {self._capacity}")
            fresh = max(wanted - len(hits), 0)
            for index in range(len(hits), stored_upto):
                if not _is_hash(hashes[index]):
                    _bad_hash(hashes[index])
        removed = self._pin_and_reserve(hits, fresh)
        if removed is None:
            return None
        ids: list[int] = []
        for copy in hits:
            copy.holds += _PIN_TO_REF
            ids.append(copy.id)
        self._refs += len(hits)
        stored: list[bool] = []
        for index in range(len(hits), len(hits) + fresh):
            copy = self._new_copy(None)
            ids.append(copy.id)
            if index < stored_upto:
                stored.append(self._cache(copy, hashes[index]))
        return Admission(
            cast("list[BlockId]", ids), len(hits), active, cast("list[int]", removed), stored
        )

    def admit_each(self, counts: object) -> tuple[list[BlockId], list[list[int]]] | None:
        """`admit` of no chain and ``extra=count`` for each of ``counts`` in order, all or
        nothing: the fresh ids of every admission in one list (in order) and each one's
        removed hashes, or None, changing nothing, when they do not all fit.

        The same copies, ids, evictions and counters as those calls one after another: a
        run of decode steps growing one table after another costs one call, not one
        `Admission` per table. Raises `InvalidArgumentError` for a count that is not an
        int >= 0 and `CapacityError` for one that could never fit.
        """
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
        # Admissions only take: if all of them fit together, each one fits in its turn.
        if total - self._capacity + self._num_copies + self._reserved > self._num_inactive:
            return None  # refused whole: no admission was made, so none failed either
        ids: list[int] = []
        removed: list[list[int]] = []
        for fresh in wanted:
            evicted = self._pin_and_reserve(_NO_HITS, fresh)
            removed.append(cast("list[int]", evicted))
            ids.extend([self._new_copy(None).id for _ in range(fresh)])
        return cast("list[BlockId]", ids), removed

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
        ids: list[BlockId] = []
        for copy in prefix:
            copy.holds += _PIN_TO_REF
            ids.append(BlockId(copy.id))
        self._refs += len(ids)
        return ids

    def allocate_private(self, reservation: object) -> BlockId:
        """Spend one reserved unit on a new request-private copy."""
        if type(reservation) is not Reservation or reservation._pool is not self:
            _foreign(reservation)
        fresh = reservation._fresh
        if fresh <= 0:  # a cancelled reservation has none left either
            _exhausted(reservation)
        reservation._fresh = fresh - 1
        return BlockId(self._new_copy(None).id)

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
        copy = self._new_copy(block_hash)
        if self._by_hash.setdefault(block_hash, copy) is copy:
            return BlockId(copy.id), True
        self._add_duplicate(block_hash, copy)
        return BlockId(copy.id), False

    def cache_private(self, block_id: object, block_hash: object) -> bool:
        """Make a private copy findable; True iff it is the hash's first resident copy."""
        copy = self._live(block_id)
        if copy.hash is not None:
            _already_cached(copy)
        if not _is_hash(block_hash):
            _bad_hash(block_hash)
        return self._cache(copy, block_hash)

    def cache_many(self, pairs: object) -> list[bool]:
        """`cache_private` for each ``(block_id, hash)`` pair in order, all or nothing.

        Every pair is checked first (a live private copy, named once in the batch, and a
        valid hash), so a bad pair raises before anything changes. Returns the flags.
        """
        items = pairs if type(pairs) is list else _as_list(pairs)
        copies: list[Copy] = []
        hashes: list[object] = []
        try:
            for pair in items:
                if (type(pair) is not tuple and type(pair) is not list) or len(pair) != 2:
                    raise InvalidArgumentError(f"expected a (block_id, hash) pair, got {pair!r}")
                copies.append(self._claim(pair[0], pair[1]))
                hashes.append(pair[1])
        except PoolError:
            for copy in copies:
                copy.hash = None
            raise
        return [self._cache(copies[i], hashes[i]) for i in range(len(copies))]

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
        copies: list[Copy] = []
        try:
            for i in range(len(ids)):
                copies.append(self._claim(ids[i], keys[i]))  # noqa: PERF401 (kept on a refusal)
        except PoolError:
            for copy in copies:
                copy.hash = None
            raise
        return [self._cache(copies[i], keys[i]) for i in range(len(copies))]

    def _claim(self, block_id: object, block_hash: object) -> Copy:
        """A batch's check of one pair: the live private copy, marked as claimed until
        the batch acts (the caller clears the marks if the batch is refused)."""
        copy = self._live(block_id)
        if copy.hash is not None:
            if copy.hash is _CLAIMED:
                raise AlreadyCachedError(f"block {copy.id} appears twice in one batch")
            _already_cached(copy)
        if not _is_hash(block_hash):
            _bad_hash(block_hash)
        copy.hash = _CLAIMED  # so that a second mention of the copy is refused
        return copy

    def release(self, block_id: object) -> None:
        """Drop one request reference: a private copy is freed, a cached one may go idle."""
        copy = self._live(block_id)
        if not copy.holds & REF_MASK:
            _not_referenced(copy, 1)
        self._release(copy)

    def release_many(self, block_ids: object) -> None:
        """`release` each id in the order given, all or nothing.

        Every id is checked first (live, holding at least as many references as it is
        named in the batch), so a bad id raises before anything changes. Callers pass a
        request's table reversed to release it leaf first.
        """
        for copy in self._releasable(block_ids):
            self._release(copy)

    def unadmit(self, block_ids: object) -> None:
        """Undo an `admit` whose result nobody used: `release_many` of its ids (pass them
        leaf first), except that a cached copy going idle returns to the LRU place it
        would hold had the admit never happened (by its stamp), not to the tail.

        Evictions the admit made stay made. Raises as `release_many`, changing nothing.
        """
        for copy in self._releasable(block_ids):
            if copy.hash is None:
                self._release(copy)
                continue
            holds = copy.holds - 1
            copy.holds = holds
            self._refs -= 1
            if not holds:
                self._link_by_stamp(copy)

    def _releasable(self, block_ids: object) -> list[Copy]:
        """The copies ``block_ids`` name, each checked to hold as many references as it
        is named; raises before anything changes."""
        ids = block_ids if type(block_ids) is list else _as_list(block_ids)
        copies: list[Copy] = []
        try:
            for block_id in ids:
                copy = self._live(block_id)
                if not copy.holds & REF_MASK:
                    _not_referenced(copy, 1 + sum(1 for seen in copies if seen is copy))
                copy.holds -= 1  # taken back below: a later mention sees one ref fewer
                copies.append(copy)
        finally:
            for copy in copies:
                copy.holds += 1
        return copies

    def unallocate(self, block_id: object, reservation: object = None) -> None:
        """Undo an allocation: the copy leaves the pool as if it had never been allocated.

        The copy must hold nothing but the one reference its allocation gave it (refs 1,
        pins 0); a cached one leaves the prefix cache too (a duplicate's siblings keep
        its hash resident). Its unit goes back to ``reservation`` as a fresh unit when
        one is given and still open, else to free capacity. Raises UnknownBlockError,
        BlockNotReferencedError (an idle copy: nothing to undo), BlockSharedError,
        ForeignReservationError and ReservationClosedError.
        """
        copy = self._live(block_id)
        if reservation is not None:
            if type(reservation) is not Reservation or reservation._pool is not self:
                _foreign(reservation)
            if reservation._closed:
                _closed(reservation)
        if not copy.holds:
            _not_referenced(copy, 1)
        if copy.holds != 1:
            raise BlockSharedError(
                f"block {copy.id} is held by more than its allocation "
                f"(refs={copy.refs}, pins={copy.pins}); release it instead"
            )
        block_hash = copy.hash
        if block_hash is not None:
            dups = self._dups
            later = dups.get(block_hash) if dups else None
            if later is None:
                del self._by_hash[block_hash]
            else:
                if self._by_hash[block_hash] is copy:
                    self._by_hash[block_hash] = later.pop(0)
                else:
                    later.remove(copy)
                if not later:
                    del dups[block_hash]
        self._slots[copy.id & _SLOT_MASK] = None
        self._free.append(copy)
        self._num_copies -= 1
        self._refs -= 1
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
            sentinel = self._lru
            linked = 0
            # Leaf first: a suffix becomes an older LRU candidate than its parent.
            for copy in reversed(prefix):
                holds = copy.holds - PIN
                copy.holds = holds
                if undo:
                    if not holds:
                        self._link_by_stamp(copy)  # counts itself
                    continue
                clock = self._clock + 1
                self._clock = clock
                copy.stamp = clock
                if not holds:
                    tail = cast(Copy, sentinel.prev)
                    tail.next = copy
                    copy.prev = tail
                    copy.next = sentinel
                    sentinel.prev = copy
                    linked += 1
            self._num_inactive += linked
        fresh = reservation._fresh
        if fresh:
            self._reserved -= fresh
            reservation._fresh = 0

    def _link_by_stamp(self, copy: Copy) -> None:
        """Link an idle copy into the LRU at its stamp's place (from the tail back: an
        undo follows its call closely, so the place is near the tail)."""
        sentinel = self._lru
        node = cast(Copy, sentinel.prev)
        stamp = copy.stamp
        while node is not sentinel and node.stamp > stamp:
            node = cast(Copy, node.prev)
        nxt = cast(Copy, node.next)
        node.next = copy
        copy.prev = node
        copy.next = nxt
        nxt.prev = copy
        self._num_inactive += 1

    # -------------------------------------------------------------- internals

    def _resident(self, block_hash: object) -> Copy | None:
        """The first copy of a resident hash, None for a valid absent one; a malformed
        hash raises `InvalidHashError` (a resident hash was range-checked when cached)."""
        try:
            copy = self._by_hash.get(block_hash)
        except TypeError:  # unhashable
            _bad_hash(block_hash)
        if copy is None or type(block_hash) is not int:
            if not _is_hash(block_hash):
                _bad_hash(block_hash)
            return None
        return copy

    def _pin_and_reserve(self, hits: list[Copy], fresh: int) -> list[object] | None:
        """Pin the validated prefix ``hits`` and reserve ``fresh`` units, evicting from
        the LRU head as needed; the removed hashes, or None (nothing changed) if even
        evicting every unpinned inactive copy would not make room."""
        needed = fresh - self._capacity + self._num_copies + self._reserved
        if needed > 0:
            evictable = self._num_inactive
            if needed > evictable - len(hits):
                # Inactive prefix copies get pinned first, so they are not evictable.
                evictable -= len({id(copy) for copy in hits if not copy.holds})
                if needed > evictable:
                    self._reserve_failures += 1
                    return None

        unlinked = 0
        for copy in hits:
            holds = copy.holds
            if not holds:
                # Leave the LRU before the pin: membership follows refs and pins.
                prev = cast(Copy, copy.prev)  # linked: holds == 0
                nxt = cast(Copy, copy.next)
                prev.next = nxt
                nxt.prev = prev
                copy.prev = copy.next = None
                unlinked += 1
            copy.holds = holds + PIN
        self._num_inactive -= unlinked

        removed: list[object] = []
        if needed > 0:
            self._evict(needed, removed)
            self._evictions += needed
        self._reserved += fresh
        self._reserves += 1
        return removed

    def _live(self, block_id: object) -> Copy:
        """The live copy ``block_id`` names, or `UnknownBlockError`."""
        if type(block_id) is not int:
            _unknown(block_id)
        slot = block_id & _SLOT_MASK
        copy = self._slots[slot] if slot < len(self._slots) else None
        if copy is None or copy.id != block_id:
            _unknown(block_id)
        return copy

    def _cache(self, copy: Copy, block_hash: object) -> bool:
        """Index a validated private copy under ``block_hash``; True on the first copy."""
        copy.hash = block_hash
        if self._by_hash.setdefault(block_hash, copy) is copy:
            return True
        self._add_duplicate(block_hash, copy)
        return False

    def _release(self, copy: Copy) -> None:
        """Drop one reference of a validated copy (a private copy holds exactly one)."""
        if copy.hash is None:
            self._slots[copy.id & _SLOT_MASK] = None
            self._free.append(copy)
            self._num_copies -= 1
            self._refs -= 1
            return
        holds = copy.holds - 1
        copy.holds = holds
        self._refs -= 1
        clock = self._clock + 1
        self._clock = clock
        copy.stamp = clock
        if not holds:
            sentinel = self._lru
            tail = cast(Copy, sentinel.prev)
            tail.next = copy
            copy.prev = tail
            copy.next = sentinel
            sentinel.prev = copy
            self._num_inactive += 1

    def _new_copy(self, block_hash: object) -> Copy:
        """Spend one reserved unit on a copy holding one reference, in a free slot."""
        block_id = self._next_id
        if block_id >= self._id_limit:
            block_id = self._take_ids()
        self._next_id = block_id + _ID_STEP
        free = self._free
        if free:
            copy = free.pop()  # unlinked and unindexed when it left
            slot = copy.id & _SLOT_MASK
            copy.id = block_id | slot
            copy.hash = block_hash
            copy.holds = 1
            copy.stamp = 0
            self._slots[slot] = copy
        else:
            copy = Copy(block_id | len(self._slots), block_hash, 1)
            self._slots.append(copy)
        self._reserved -= 1
        self._num_copies += 1
        self._refs += 1
        return copy

    def _take_ids(self) -> int:
        """Claim the next process-wide range of ids; returns its first (slot-less) id."""
        first = next(_id_ranges) * _IDS_PER_RANGE * _ID_STEP
        self._id_limit = first + _IDS_PER_RANGE * _ID_STEP
        return first

    def _add_duplicate(self, block_hash: object, copy: Copy) -> None:
        later = self._dups.get(block_hash)
        if later is None:
            self._dups[block_hash] = [copy]
        else:
            later.append(copy)

    def _evict(self, count: int, removed: list[object]) -> None:
        """Evict ``count`` copies from the LRU head; a hash is removed on its last copy."""
        sentinel = self._lru
        slots = self._slots
        free = self._free
        by_hash = self._by_hash
        dups = self._dups
        copy = cast(Copy, sentinel.next)  # count <= inactive: the sentinel is never reached
        for _ in range(count):
            slots[copy.id & _SLOT_MASK] = None
            free.append(copy)
            block_hash = copy.hash
            if dups and block_hash in dups:
                later = dups[block_hash]
                if by_hash[block_hash] is copy:
                    by_hash[block_hash] = later.pop(0)
                else:
                    later.remove(copy)
                if not later:
                    del dups[block_hash]
            else:
                del by_hash[block_hash]
                removed.append(block_hash)
            # Unlink fully: adjacent evicted copies would otherwise keep each other alive.
            nxt = cast(Copy, copy.next)
            copy.prev = copy.next = None
            copy = nxt
        sentinel.next = copy
        copy.prev = sentinel
        self._num_copies -= count
        self._num_inactive -= count

    # ------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Re-derive all state from scratch; raise `InvariantViolationError` on any breach.

        The reference's LRU consistency check, plus: every cached copy is indexed exactly
        once, no hash entry is empty, counters match, copies + reserved <= capacity.
        """
        live: dict[int, Copy] = {}
        for slot, copy in enumerate(self._slots):
            if copy is None:
                continue
            _require(copy.id & _SLOT_MASK == slot, f"copy {copy.id} sits in slot {slot}")
            _require(copy.id not in live, f"copy {copy.id} occupies two slots")
            live[copy.id] = copy
        _require(len(live) == self._num_copies, "live copy count does not match its counter")
        _require(len(self._slots) <= self._capacity, "more slots than capacity")
        _require(
            sorted(c.id & _SLOT_MASK for c in self._free)
            == [s for s, c in enumerate(self._slots) if c is None],
            "free-slot list does not match the empty slots",
        )
        _require(self._reserved >= 0, "reserved capacity is negative")
        _require(
            self._num_copies + self._reserved <= self._capacity,
            "block-pool occupancy exceeds capacity",
        )

        # The reference's assert_lru_consistent, on the circular list.
        sentinel = self._lru
        linked: set[int] = set()
        previous = sentinel
        cursor = sentinel.next
        while cursor is not sentinel:
            _require(cursor is not None, "inactive LRU is broken (a missing link)")
            assert cursor is not None
            _require(id(cursor) not in linked, "inactive LRU contains a cycle")
            linked.add(id(cursor))
            _require(live.get(cursor.id) is cursor, "inactive LRU points to a missing copy")
            _require(cursor.hash is not None, "inactive LRU contains a private copy")
            _require(
                (cursor.refs, cursor.pins) == (0, 0),
                "active copy is linked into the inactive LRU",
            )
            _require(cursor.prev is previous, "inactive LRU contains a broken back-pointer")
            _require(
                previous is sentinel or previous.stamp <= cursor.stamp,
                "inactive LRU is out of stamp order",
            )
            previous = cursor
            cursor = cursor.next
        _require(sentinel.prev is previous, "inactive LRU tail does not match its last copy")
        _require(
            len(linked) == self._num_inactive,
            "inactive LRU length does not match its reachable copies",
        )

        refs = 0
        for copy in live.values():
            _require(copy.holds >= 0, f"copy {copy.id} has a negative reference or pin count")
            if copy.hash is None:
                _require(
                    (copy.refs, copy.pins) == (1, 0),
                    f"private copy {copy.id} must hold one reference and no pin",
                )
                _require(id(copy) not in linked, "private copy is in the inactive LRU")
            else:
                should_be_linked = copy.refs == 0 and copy.pins == 0
                _require(
                    (id(copy) in linked) == should_be_linked,
                    "cached copy membership disagrees with its refs and pins",
                )
                if not should_be_linked:
                    _require(
                        copy.prev is None and copy.next is None,
                        "active cached copy retains inactive LRU links",
                    )
            refs += copy.refs
        _require(refs == self._refs, "request reference count does not match its counter")

        indexed: dict[int, int] = {}
        for block_hash, first in self._by_hash.items():
            chain = [first, *self._dups.get(block_hash, ())]
            for copy in chain:
                _require(
                    copy.hash == block_hash, f"hash {block_hash} indexes a copy of another hash"
                )
                _require(live.get(copy.id) is copy, f"hash {block_hash} indexes a dead copy")
                indexed[id(copy)] = indexed.get(id(copy), 0) + 1
        for block_hash, later in self._dups.items():
            _require(bool(later), f"hash {block_hash} has an empty duplicate list")
            _require(block_hash in self._by_hash, f"duplicates of {block_hash} have no first copy")
        for copy in live.values():
            expected = 0 if copy.hash is None else 1
            _require(
                indexed.get(id(copy), 0) == expected,
                f"copy {copy.id} is indexed {indexed.get(id(copy), 0)} times, expected {expected}",
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


def _already_cached(copy: Copy) -> NoReturn:
    raise AlreadyCachedError(
        f"block {copy.id} is already cached (hash {copy.hash}); "
        "only a private copy can enter the prefix cache"
    )


def _not_referenced(copy: Copy, count: int) -> NoReturn:
    refs = copy.holds & REF_MASK
    if count == 1:
        raise BlockNotReferencedError(
            f"block {copy.id} (hash {copy.hash}) holds no request reference to release"
        )
    raise BlockNotReferencedError(
        f"block {copy.id} is released {count} times but holds {refs} request reference(s)"
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
    if 0 <= value <= _MAX_UNBOXED:  # compiled: compares as machine words, no boxing
        return True
    return 0 <= value <= MAX_HASH
