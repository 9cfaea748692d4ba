"""The async client of the pool actor: one method per message, plus lease and reservation.

Every method is a coroutine that makes one actor call, so it is always a checkpoint.
It returns what the `BlockPool` method of the same name returns and raises the same
`PoolError` classes, plus `PoolClosedError` after the pool shut down and
`PoolCrashedError` after the actor died of a bug. Cancellation: `kvpool.actors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, overload

import anyio
import anyio.lowlevel

from kvpool.actors.actor import Actor
from kvpool.actors.slots import interrupt_safe
from kvpool.errors import (
    ForeignReservationError,
    PoolClosedError,
    PoolCrashedError,
    PoolError,
    WrongLoopError,
)
from kvpool.messages import (
    ActivatePrefix,
    Admission,
    Admit,
    AdmitReply,
    AllocateCached,
    AllocatePrivate,
    CacheMany,
    CachePrivate,
    Cancel,
    CheckInvariants,
    FlagReply,
    FlagsReply,
    Free,
    GetStats,
    PoolStats,
    PrefixHitReply,
    QueryPrefix,
    Release,
    Reserve,
    StatsReply,
)
from kvpool.pool import BlockId, PrefixHit

_GET_STATS = GetStats()
_CHECK_INVARIANTS = CheckInvariants()


class ActorReservation:
    """A reservation held through the actor: its handle id plus what it still holds.

    The counts are the client's mirror of the actor's record, updated as replies
    arrive; ``closed`` turns true once a cancel was posted (it then takes effect, even
    if its caller is cancelled), never for a cancel refused before posting
    (`WrongLoopError`).
    """

    __slots__ = ("_client", "_closed", "_fresh", "_prefix_len", "id")

    def __init__(self, client: PoolClient, handle: int, prefix_len: int, fresh: int) -> None:
        self._client = client
        self.id = handle
        self._prefix_len = prefix_len
        self._fresh = fresh
        self._closed = False

    def __len__(self) -> int:
        return self._prefix_len + self._fresh

    @property
    def fresh(self) -> int:
        """Fresh (not prefix) blocks still reserved and not yet allocated."""
        return self._fresh

    @property
    def prefix_len(self) -> int:
        """Pinned prefix blocks not yet activated."""
        return self._prefix_len

    @property
    def closed(self) -> bool:
        """True once a cancel of this reservation was posted (or the pool is gone)."""
        return self._closed

    def __repr__(self) -> str:
        if self._closed:
            return f"ActorReservation({self.id}, closed)"
        return f"ActorReservation({self.id}, prefix={self._prefix_len}, fresh={self._fresh})"


@dataclass(frozen=True, slots=True)
class ActorReserveOutcome:
    """A successful reserve through the actor: the reservation and the evicted hashes."""

    reservation: ActorReservation
    removed: list[int]


class Lease:
    """Blocks admitted by `PoolClient.lease`; whatever it still holds is freed on exit."""

    __slots__ = ("_client", "admission", "blocks")

    def __init__(self, client: PoolClient, admission: Admission) -> None:
        self._client = client
        self.admission = admission
        self.blocks: list[BlockId] = list(admission.blocks)
        """Ids the lease still holds, in chain order."""

    def detach(self) -> list[BlockId]:
        """Take ownership of every held block: the lease frees nothing on exit."""
        blocks, self.blocks = self.blocks, []
        return blocks

    @interrupt_safe
    async def free(self, count: int | None = None) -> None:
        """Free the last ``count`` held blocks (all by default), leaf first, now.

        A give-back, so a checkpoint even with nothing left to free; in a cancelled
        scope it takes effect and raises the cancellation (`kvpool.actors`). The blocks
        leave `blocks` once the free was posted; a free refused before it was posted
        (`WrongLoopError`) or by the pool (a `PoolError`: nothing was freed) leaves
        `blocks` as it was.
        """
        cut = 0 if count is None else max(len(self.blocks) - count, 0)
        released = self.blocks[cut:]
        if not released:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await self._client.free(released)
        except (PoolClosedError, PoolCrashedError):
            del self.blocks[cut:]  # the pool is gone, and the blocks with it
            raise
        except PoolError:
            raise  # refused: nothing was freed, the lease still holds them
        except BaseException:
            del self.blocks[cut:]  # posted, so it takes effect: the caller just left
            raise
        del self.blocks[cut:]


class PoolClient:
    """The handle `open_pool` yields; usable from any task on the same event loop."""

    __slots__ = ("_actor", "_call", "capacity")

    def __init__(self, actor: Actor, capacity: int) -> None:
        self._actor = actor
        self._call = actor.call
        self.capacity = capacity

    async def call(self, message: Any) -> Any:
        """Send any registered message (an extension's) and return its handler's reply.

        Raises what the handler raised, `InvalidArgumentError` for an unregistered
        kind, `PoolClosedError` / `PoolCrashedError` once the actor is gone. Cancellation follows
        the handler's contract: see `kvpool.actors`.
        """
        return await self._call(message)

    # ------------------------------------------------------------- queries

    async def prefix_hit(self, block_hash: int) -> PrefixHit | None:
        """Whether ``block_hash`` is resident and whether its first copy is in use.

        Raises InvalidHashError.
        """
        reply: PrefixHitReply = await self._call(QueryPrefix(block_hash))
        return reply.hit

    async def stats(self) -> PoolStats:
        """Occupancy plus cumulative counters."""
        reply: StatsReply = await self._call(_GET_STATS)
        return reply.stats

    async def check_invariants(self) -> None:
        """Re-derive the pool's state; a breach crashes the actor (PoolCrashedError here)."""
        await self._call(_CHECK_INVARIANTS)

    # -------------------------------------------------------- reservations

    @interrupt_safe
    async def reserve(self, prefix: Sequence[int], fresh: int) -> ActorReserveOutcome | None:
        """Pin the resident ``prefix`` and reserve ``fresh`` blocks, all or nothing.

        Returns None when it does not fit. Raises InvalidArgumentError,
        InvalidHashError, PrefixNotResidentError.
        """
        reply = await self._call(Reserve(prefix, fresh))  # type: ignore[arg-type]
        if reply.reservation is None:
            return None
        reservation = ActorReservation(self, reply.reservation, reply.prefix_len, reply.fresh)
        return ActorReserveOutcome(reservation, reply.removed)

    @interrupt_safe
    async def activate_prefix(self, reservation: ActorReservation) -> list[BlockId]:
        """Turn the reservation's prefix pins into references; returns their ids root first.

        Raises ForeignReservationError, ReservationClosedError.
        """
        handle = self._handle(reservation)
        if handle is None:
            await _refuse_foreign(reservation)
        reply = await self._call(ActivatePrefix(handle))
        block_ids: list[BlockId] = reply.block_ids
        if block_ids:
            reservation._prefix_len = 0
        return block_ids

    @interrupt_safe
    async def allocate_private(self, reservation: ActorReservation) -> BlockId:
        """Spend one reserved unit on a new private copy; returns its id.

        Raises ForeignReservationError, ReservationClosedError, ReservationExhaustedError.
        """
        handle = self._handle(reservation)
        if handle is None:
            await _refuse_foreign(reservation)
        reply = await self._call(AllocatePrivate(handle))
        reservation._fresh -= 1
        block_id: BlockId = reply.block_id
        return block_id

    @interrupt_safe
    async def allocate_cached(
        self, reservation: ActorReservation, block_hash: int
    ) -> tuple[BlockId, bool]:
        """Allocate straight into the cache: (id, True iff the hash became visible).

        Raises as `allocate_private`, plus InvalidHashError.
        """
        handle = self._handle(reservation)
        if handle is None:
            await _refuse_foreign(reservation)
        reply = await self._call(AllocateCached(handle, block_hash))
        reservation._fresh -= 1
        return reply.block_id, reply.visible

    @interrupt_safe
    async def cancel(self, reservation: ActorReservation) -> None:
        """Return unconsumed capacity and unpin the unactivated prefix, leaf first.

        Raises ForeignReservationError, ReservationClosedError. Takes effect once
        posted, even if the caller is then cancelled; refused before posting
        (`WrongLoopError`), it leaves the reservation open.
        """
        handle = self._handle(reservation)
        if handle is None:
            await _refuse_foreign(reservation)
        try:
            await self._call(Cancel(handle))
        except WrongLoopError:
            raise  # refused before it was posted: the reservation is still open
        except BaseException:
            reservation._closed = True  # posted (or the pool is gone): it took effect
            raise
        reservation._closed = True

    @asynccontextmanager
    async def reservation(
        self, prefix: Sequence[int], fresh: int
    ) -> AsyncIterator[ActorReserveOutcome | None]:
        """`reserve` on entry (None if it did not fit); cancel what is left on any exit."""
        outcome = await self.reserve(prefix, fresh)
        try:
            yield outcome
        finally:
            if outcome is not None and not outcome.reservation.closed:
                # The pool being gone takes the reservation with it.
                with anyio.CancelScope(shield=True), suppress(PoolClosedError, PoolCrashedError):
                    await self.cancel(outcome.reservation)

    # -------------------------------------------------------------- blocks

    async def cache_private(self, block_id: BlockId, block_hash: int) -> bool:
        """Make a private copy findable; True iff it is the hash's first resident copy.

        Raises UnknownBlockError, AlreadyCachedError, InvalidHashError.
        """
        reply: FlagReply = await self._call(CachePrivate(block_id, block_hash))
        return reply.visible

    async def release(self, block_id: BlockId) -> None:
        """Drop one reference to ``block_id``. Raises UnknownBlockError,
        BlockNotReferencedError.
        """
        await self._call(Release(block_id))

    # ------------------------------------------------------------- batches

    async def admit(
        self, chain: Sequence[int], extra: int = 0, *, wait: bool = False
    ) -> Admission | None:
        """In one turn: reuse ``chain``'s resident prefix, allocate the rest and ``extra``.

        Returns the `Admission`, or None when it does not fit now and ``wait`` is false
        (an immediate try, which may succeed while larger waiters keep waiting). With
        ``wait`` the request queues FIFO until it fits. Raises CapacityError when it can
        never fit, InvalidArgumentError / InvalidHashError for a malformed chain.
        """
        reply: AdmitReply = await self._call(Admit(chain, extra, wait))  # type: ignore[arg-type]
        return reply.admission

    async def cache_many(self, pairs: Sequence[tuple[BlockId, int]]) -> list[bool]:
        """`cache_private` for every ``(block_id, hash)`` pair in one turn, all or nothing.

        Returns the visibility flags in order. Raises as `cache_private` (naming the
        first bad pair) and changes nothing.
        """
        reply: FlagsReply = await self._call(CacheMany(pairs))  # type: ignore[arg-type]
        return reply.visible

    async def free(self, block_ids: Sequence[BlockId]) -> None:
        """Release every block, last first (leaf first), all or nothing.

        Raises InvalidArgumentError, UnknownBlockError, BlockNotReferencedError and
        releases nothing.
        """
        await self._call(Free(block_ids))  # type: ignore[arg-type]

    @overload
    def lease(
        self, chain: Sequence[int], extra: int = ..., *, wait: Literal[True] = ...
    ) -> AbstractAsyncContextManager[Lease]: ...

    @overload
    def lease(
        self, chain: Sequence[int], extra: int = ..., *, wait: bool
    ) -> AbstractAsyncContextManager[Lease | None]: ...

    def lease(self, chain: Sequence[int], extra: int = 0, *, wait: bool = True) -> Any:
        """`admit` on entry (waiting by default); `free` whatever the lease holds on exit.

        Yields a `Lease`, or None when ``wait`` is false and the chain does not fit.
        The exit frees in a shielded scope, so it completes under cancellation too.
        """
        return self._lease(chain, extra, wait)

    @asynccontextmanager
    async def _lease(self, chain: Sequence[int], extra: int, wait: bool) -> AsyncIterator[Any]:
        admission = await self.admit(chain, extra, wait=wait)
        if admission is None:
            yield None
            return
        lease = Lease(self, admission)
        try:
            yield lease
        finally:
            if lease.blocks:
                # The pool being gone takes the blocks with it.
                with anyio.CancelScope(shield=True), suppress(PoolClosedError, PoolCrashedError):
                    await lease.free()

    # ----------------------------------------------------------- internals

    def _handle(self, reservation: object) -> int | None:
        if type(reservation) is ActorReservation and reservation._client is self:
            return reservation.id
        return None


async def _refuse_foreign(reservation: object) -> NoReturn:
    """Raise ForeignReservationError after a checkpoint (a refused call always yields)."""
    await anyio.lowlevel.checkpoint()
    if isinstance(reservation, ActorReservation):
        raise ForeignReservationError(f"{reservation!r} belongs to another pool")
    raise ForeignReservationError(f"expected an ActorReservation, got {reservation!r}")


# A context manager's entry and exit bookkeeping is the client's too (`interrupt_safe`).
interrupt_safe(PoolClient.reservation.__wrapped__)  # type: ignore[attr-defined]
interrupt_safe(PoolClient._lease.__wrapped__)  # type: ignore[attr-defined]
