"""The pool service: the pool actor's state (a `BlockPool`, reservation handles) and
`OPERATIONS`, one declaration per message kind of `kvpool.messages` (the layout every
service follows: `kvpool.actors.operation`).

Every undo is exact, LRU order included: prefix copies an undone call took from the
LRU go back to their place in it (`BlockPool.unreserve`, `BlockPool.unadmit`).

Reservations cross the protocol as integer handle ids. Each handle names a `_Held`
record: the pool reservations backing it (more than one only after an undo topped it up)
and the prefix hashes it still pins, so an undone ``activate_prefix`` or ``allocate_*``
can give the reservation back exactly what the call took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from kvpool.actors.actor import WAIT, Handler, Wait
from kvpool.actors.operation import Operation, handler_table
from kvpool.errors import (
    BlockSharedError,
    ForeignReservationError,
    InvariantViolationError,
    ReservationClosedError,
)
from kvpool.messages import (
    ActivatePrefix,
    Admit,
    AdmitReply,
    AllocateCached,
    AllocatePrivate,
    BlockReply,
    BlocksReply,
    CachedBlockReply,
    CacheMany,
    CachePrivate,
    Cancel,
    CheckInvariants,
    DoneReply,
    FlagReply,
    FlagsReply,
    Free,
    GetStats,
    PoolStats,
    PrefixHitReply,
    QueryPrefix,
    Release,
    Reserve,
    ReserveReply,
    StatsReply,
)
from kvpool.pool import BlockPool, PrefixHit, Reservation
from kvpool.pool.items import as_list

_DONE = DoneReply()
_MISS = PrefixHitReply(None)
_ACTIVE_HIT = PrefixHitReply(PrefixHit(True))
_INACTIVE_HIT = PrefixHitReply(PrefixHit(False))
_NO_ROOM = ReserveReply(None)
_NOT_ADMITTED = AdmitReply(None)


class _Held:
    """What one reservation handle holds: its pool reservations and unactivated prefix."""

    __slots__ = ("activated", "parts", "prefix")

    def __init__(self, part: Reservation, prefix: list[int]) -> None:
        self.parts = [part]
        self.prefix = prefix  # hashes pinned and not yet activated, root first
        self.activated: list[int] = []  # hashes the last non-empty activation turned into refs


class PoolState:
    """Everything the pool actor owns; its handlers are the only code that touches it.

    Extensions get this object: ``pool`` is the `BlockPool` they may drive from their
    own handlers (in the same turn-by-turn discipline). The pool counts its own reserves
    and evictions (`BlockPool.reserves`).
    """

    __slots__ = ("_held", "_next_handle", "count_waiters", "pool")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.count_waiters: Callable[[], int] = lambda: 0
        """The actor's FIFO length, for `stats` (set by the host once the actor exists)."""
        self._held: dict[int, _Held] = {}
        self._next_handle = 1

    def table(self) -> dict[type[Any], Handler[Any, Any]]:
        """The handler table of `OPERATIONS` over this state."""
        return handler_table(OPERATIONS, self)

    # ------------------------------------------------------------- 1:1 calls

    def query_prefix(self, message: QueryPrefix) -> PrefixHitReply:
        hit = self.pool.prefix_hit(message.block_hash)
        if hit is None:
            return _MISS
        return _ACTIVE_HIT if hit.is_active else _INACTIVE_HIT

    def reserve(self, message: Reserve) -> ReserveReply:
        outcome = self.pool.reserve(message.prefix, message.fresh)
        if outcome is None:
            return _NO_ROOM
        reservation = outcome.reservation
        handle = self._next_handle
        self._next_handle = handle + 1
        self._held[handle] = _Held(reservation, list(message.prefix))
        return ReserveReply(handle, reservation.prefix_len, reservation.fresh, outcome.removed)

    def undo_reserve(self, message: Reserve, reply: ReserveReply) -> None:
        if reply.reservation is not None:
            held = self._held.pop(reply.reservation, None)
            if held is not None:
                for part in held.parts:
                    self.pool.unreserve(part)  # idle prefix copies back at their LRU place

    def activate_prefix(self, message: ActivatePrefix) -> BlocksReply:
        held = self._lookup(message.reservation)
        block_ids: list[int] = []
        for part in held.parts:
            block_ids += self.pool.activate_prefix(part)
        if block_ids:
            held.activated = held.prefix
            held.prefix = []
        return BlocksReply(block_ids)

    def undo_activate_prefix(self, message: ActivatePrefix, reply: BlocksReply) -> None:
        if not reply.block_ids:
            return
        self.pool.unadmit(reply.block_ids[::-1])  # type: ignore[arg-type]  # leaf first
        held = self._held.get(message.reservation)
        if held is not None:
            # The copies still hold the hashes (our references kept them from eviction),
            # so pinning them again fits without evicting anything.
            outcome = self.pool.reserve(held.activated, 0)
            if outcome is None:
                raise InvariantViolationError("re-pinning an undone prefix did not fit")
            held.parts.append(outcome.reservation)
            held.prefix = held.activated
            held.activated = []

    def allocate_private(self, message: AllocatePrivate) -> BlockReply:
        part = self._part_with_fresh(self._lookup(message.reservation))
        return BlockReply(self.pool.allocate_private(part))

    def allocate_cached(self, message: AllocateCached) -> CachedBlockReply:
        part = self._part_with_fresh(self._lookup(message.reservation))
        block_id, visible = self.pool.allocate_cached(part, message.block_hash)
        return CachedBlockReply(block_id, visible)

    def undo_allocate(
        self, message: AllocatePrivate | AllocateCached, reply: BlockReply | CachedBlockReply
    ) -> None:
        """The copy leaves the pool and its unit returns to the reservation (or to free
        capacity if the reservation was cancelled since): exactly as before the call."""
        held = self._held.get(message.reservation)
        part = None if held is None else held.parts[0]
        try:
            self.pool.unallocate(reply.block_id, part)  # type: ignore[arg-type]
        except BlockSharedError:
            # Another request found the cached copy since: it stays, idle once they
            # release it, and the unit comes back from free or evictable capacity.
            self.pool.release(reply.block_id)  # type: ignore[arg-type]
            if held is not None:
                outcome = self.pool.reserve((), 1)
                if outcome is not None:
                    held.parts.append(outcome.reservation)

    def cache_private(self, message: CachePrivate) -> FlagReply:
        return FlagReply(self.pool.cache_private(message.block_id, message.block_hash))  # type: ignore[arg-type]

    def release(self, message: Release) -> DoneReply:
        self.pool.release(message.block_id)  # type: ignore[arg-type]
        return _DONE

    def cancel(self, message: Cancel) -> DoneReply:
        self._lookup(message.reservation)
        held = self._held.pop(message.reservation)
        for part in held.parts:
            self.pool.cancel(part)
        return _DONE

    def stats(self, message: GetStats) -> StatsReply:
        pool = self.pool
        return StatsReply(
            PoolStats(
                capacity=pool.capacity,
                num_active=pool.num_active(),
                num_inactive=pool.num_inactive(),
                num_active_refs=pool.num_active_refs(),
                reserves=pool.reserves,
                reserve_failures=pool.reserve_failures,
                evictions=pool.evictions,
                waiters=self.count_waiters(),
            )
        )

    def check_invariants(self, message: CheckInvariants) -> DoneReply:
        self.pool.check_invariants()
        return _DONE

    # -------------------------------------------------------- batched calls

    def admit(self, message: Admit) -> AdmitReply | Wait:
        admission = self.pool.admit(message.chain, message.extra)
        if admission is None:
            return WAIT if message.wait else _NOT_ADMITTED
        return AdmitReply(admission)

    def undo_admit(self, message: Admit, reply: AdmitReply) -> None:
        if reply.admission is not None:
            # Leaf first; idle prefix copies go back to their LRU place, not the tail.
            self.pool.unadmit(reply.admission.blocks[::-1])

    def cache_many(self, message: CacheMany) -> FlagsReply:
        return FlagsReply(self.pool.cache_many(message.pairs))  # type: ignore[arg-type]

    def free(self, message: Free) -> DoneReply:
        block_ids = as_list(message.block_ids, "block_ids")
        self.pool.release_many(block_ids[::-1])  # leaf first
        return _DONE

    # ------------------------------------------------------------ internals

    def _lookup(self, handle: int) -> _Held:
        held = self._held.get(handle) if type(handle) is int else None
        if held is None:
            _bad_handle(handle, self._next_handle)
        return held

    def _part_with_fresh(self, held: _Held) -> Reservation:
        for part in held.parts:
            if part.fresh:
                return part
        return held.parts[0]  # the pool raises ReservationExhaustedError for it


def _admit_waits(message: Admit) -> bool:
    return message.wait is True


OPERATIONS: tuple[Operation[PoolState, Any, Any], ...] = (
    Operation(QueryPrefix, PrefixHitReply, PoolState.query_prefix),
    Operation(Admit, AdmitReply, PoolState.admit, undo=PoolState.undo_admit, waits=_admit_waits),
    Operation(CacheMany, FlagsReply, PoolState.cache_many),
    Operation(Free, DoneReply, PoolState.free, gives_back=True),
    Operation(Reserve, ReserveReply, PoolState.reserve, undo=PoolState.undo_reserve),
    Operation(
        ActivatePrefix,
        BlocksReply,
        PoolState.activate_prefix,
        undo=PoolState.undo_activate_prefix,
    ),
    Operation(
        AllocatePrivate, BlockReply, PoolState.allocate_private, undo=PoolState.undo_allocate
    ),
    Operation(
        AllocateCached,
        CachedBlockReply,
        PoolState.allocate_cached,
        undo=PoolState.undo_allocate,
    ),
    Operation(CachePrivate, FlagReply, PoolState.cache_private),
    Operation(Release, DoneReply, PoolState.release, gives_back=True),
    Operation(Cancel, DoneReply, PoolState.cancel, gives_back=True),
    Operation(GetStats, StatsReply, PoolState.stats),
    Operation(CheckInvariants, DoneReply, PoolState.check_invariants),
)
"""The pool protocol, one `Operation` per request kind (what cancellation does to each:
the contract in `kvpool.actors`)."""


def _bad_handle(handle: object, next_handle: int) -> NoReturn:
    if type(handle) is int and 0 < handle < next_handle:
        raise ReservationClosedError(f"reservation {handle} was already cancelled")
    raise ForeignReservationError(f"{handle!r} names no reservation of this pool")
