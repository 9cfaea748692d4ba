"""The pool actor's state and handlers: a `BlockPool`, reservation handles, counters.

Reservations cross the protocol as integer handle ids. Each handle names a `_Held`
record: the pool reservations backing it (more than one only after an undo topped it up)
and the prefix hashes it still pins, so an undone ``activate_prefix`` or ``allocate_*``
can give the reservation back exactly what the call took.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeGuard

from kvpool.actors.core import WAIT, Handler, Wait
from kvpool.errors import (
    ForeignReservationError,
    InvalidArgumentError,
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
    own handlers (in the same turn-by-turn discipline), and `record_reserve` keeps the
    statistics honest when they reserve on their own.
    """

    __slots__ = (
        "_count_waiters",
        "_held",
        "_next_handle",
        "admissions",
        "evictions",
        "pool",
        "reserve_failures",
        "reserves",
    )

    def __init__(self, pool: BlockPool, count_waiters: Callable[[], int]) -> None:
        self.pool = pool
        self._count_waiters = count_waiters
        self._held: dict[int, _Held] = {}
        self._next_handle = 1
        self.reserves = 0
        self.reserve_failures = 0
        self.evictions = 0
        self.admissions = 0

    def record_reserve(self, removed: Sequence[int] | None) -> None:
        """Count one reserve: None when it did not fit, else the hashes it removed."""
        if removed is None:
            self.reserve_failures += 1
        else:
            self.reserves += 1
            self.evictions += len(removed)

    def handlers(self) -> dict[type[Any], Handler[Any, Any]]:
        """The pool protocol's handler table."""
        return {
            QueryPrefix: Handler(self.query_prefix),
            Admit: Handler(self.admit, undo=self.undo_admit, waits=_admit_waits),
            CacheMany: Handler(self.cache_many),
            Free: Handler(self.free, gives_back=True),
            Reserve: Handler(self.reserve, undo=self.undo_reserve),
            ActivatePrefix: Handler(self.activate_prefix, undo=self.undo_activate_prefix),
            AllocatePrivate: Handler(self.allocate_private, undo=self.undo_allocate_private),
            AllocateCached: Handler(self.allocate_cached, undo=self.undo_allocate_cached),
            CachePrivate: Handler(self.cache_private),
            Release: Handler(self.release, gives_back=True),
            Cancel: Handler(self.cancel, gives_back=True),
            GetStats: Handler(self.stats),
            CheckInvariants: Handler(self.check_invariants),
        }

    # ------------------------------------------------------------- 1:1 calls

    def query_prefix(self, message: QueryPrefix) -> PrefixHitReply:
        hit = self.pool.prefix_hit(message.block_hash)
        if hit is None:
            return _MISS
        return _ACTIVE_HIT if hit.is_active else _INACTIVE_HIT

    def reserve(self, message: Reserve) -> ReserveReply:
        outcome = self.pool.reserve(message.prefix, message.fresh)
        if outcome is None:
            self.reserve_failures += 1
            return _NO_ROOM
        reservation = outcome.reservation
        self.record_reserve(outcome.removed)
        handle = self._next_handle
        self._next_handle = handle + 1
        self._held[handle] = _Held(reservation, list(message.prefix))
        return ReserveReply(handle, reservation.prefix_len, reservation.fresh, outcome.removed)

    def undo_reserve(self, message: Reserve, reply: ReserveReply) -> None:
        if reply.reservation is not None:
            self.reserves -= 1  # counters count what callers got; evictions stay counted
            held = self._held.pop(reply.reservation, None)
            if held is not None:
                for part in held.parts:
                    self.pool.cancel(part)

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
        self._release_leaf_first(reply.block_ids)
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

    def undo_allocate_private(self, message: AllocatePrivate, reply: BlockReply) -> None:
        # Releasing a private copy frees its slot, so reserving it again cannot evict.
        self.pool.release(reply.block_id)  # type: ignore[arg-type]
        self._top_up(message.reservation)

    def allocate_cached(self, message: AllocateCached) -> CachedBlockReply:
        part = self._part_with_fresh(self._lookup(message.reservation))
        block_id, visible = self.pool.allocate_cached(part, message.block_hash)
        return CachedBlockReply(block_id, visible)

    def undo_allocate_cached(self, message: AllocateCached, reply: CachedBlockReply) -> None:
        # The copy stays cached (inactive, evictable); the unit comes back to the
        # reservation from free capacity or by evicting the LRU head, if anything can go.
        self.pool.release(reply.block_id)  # type: ignore[arg-type]
        self._top_up(message.reservation)

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
                reserves=self.reserves,
                reserve_failures=self.reserve_failures,
                evictions=self.evictions,
                admissions=self.admissions,
                waiters=self._count_waiters(),
            )
        )

    def check_invariants(self, message: CheckInvariants) -> DoneReply:
        self.pool.check_invariants()
        return _DONE

    # -------------------------------------------------------- batched calls

    def admit(self, message: Admit) -> AdmitReply | Wait:
        chain = message.chain
        if type(chain) is not list and not is_sequence(chain):
            raise InvalidArgumentError(f"chain must be a sequence of ints, got {chain!r}")
        admission = self.pool.admit(chain, message.extra)
        if admission is None:
            if message.wait:
                return WAIT  # retried from the FIFO; counted once it is granted
            self.reserve_failures += 1
            return _NOT_ADMITTED
        self.reserves += 1  # record_reserve, written out on this hot path
        self.evictions += len(admission.removed)
        self.admissions += 1
        return AdmitReply(admission)

    def undo_admit(self, message: Admit, reply: AdmitReply) -> None:
        if reply.admission is not None:
            self.reserves -= 1  # counters count what callers got; evictions stay counted
            self.admissions -= 1
            self._release_leaf_first(reply.admission.blocks)

    def cache_many(self, message: CacheMany) -> FlagsReply:
        return FlagsReply(self.pool.cache_many(message.pairs))  # type: ignore[arg-type]

    def free(self, message: Free) -> DoneReply:
        block_ids = message.block_ids
        if type(block_ids) is not list and not is_sequence(block_ids):
            raise InvalidArgumentError(f"block_ids must be a sequence of ints, got {block_ids!r}")
        self.pool.release_many(block_ids[::-1])  # type: ignore[arg-type] # leaf first
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

    def _top_up(self, handle: int) -> None:
        """Give one fresh unit back to reservation ``handle`` if it is still open."""
        held = self._held.get(handle)
        if held is None:
            return
        outcome = self.pool.reserve((), 1)
        if outcome is not None:
            self.evictions += len(outcome.removed)  # not a caller's reserve: not counted
            held.parts.append(outcome.reservation)

    def _release_leaf_first(self, block_ids: Sequence[int]) -> None:
        """Release the last block first, all or nothing (the pool checks every id first)."""
        self.pool.release_many(block_ids[::-1])  # type: ignore[arg-type]


def _admit_waits(message: Admit) -> bool:
    return message.wait is True


def _bad_handle(handle: object, next_handle: int) -> NoReturn:
    if type(handle) is int and 0 < handle < next_handle:
        raise ReservationClosedError(f"reservation {handle} was already cancelled")
    raise ForeignReservationError(f"{handle!r} names no reservation of this pool")


def is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    """A sequence of items, not a string: lists and tuples answer without the ABC check."""
    kind = type(value)
    if kind is list or kind is tuple:
        return True
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def extension_handlers(
    state: PoolState,
    extensions: Sequence[Callable[[PoolState], Mapping[type[Any], Handler[Any, Any]]]],
) -> dict[type[Any], Handler[Any, Any]]:
    """The pool's handlers plus every extension's; a kind registered twice is an error."""
    table = state.handlers()
    for extension in extensions:
        for kind, handler in extension(state).items():
            if kind in table:
                raise InvalidArgumentError(f"message kind {kind.__name__} is registered twice")
            table[kind] = handler
    return table
