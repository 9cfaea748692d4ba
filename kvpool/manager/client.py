"""The manager's actor: `open_manager` and its async `ManagerClient`.

One actor task owns a `BlockPool` and a `KvManager` over it (`kvpool.manager.handlers`),
so request-level calls from any number of tasks are serialized, each one atomic, and the
router-visible events leave in the order the actor produced them. Works on asyncio,
asyncio+uvloop and trio. `ManagerClient` is also the engine's actor-backed KV client
(`kvpool.engine.KvClient`).

Example::

    async with open_manager(1024, block_size=16) as kv:
        await kv.add_request("r1", prompt)
        allocation = await kv.allocate("r1", len(prompt), wait=True)
        await kv.mark_computed("r1", len(prompt))
        batch = await kv.take_batch()        # KVEventBatch | None, for a sink
        await kv.free("r1")
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import anyio.lowlevel

from kvpool.actors import Actor, open_actor
from kvpool.actors.slots import interrupt_safe
from kvpool.errors import InvalidArgumentError
from kvpool.events import KVEvent, KVEventBatch
from kvpool.manager import KvManager
from kvpool.manager.handlers import ManagerHandlers
from kvpool.manager.messages import (
    AddRequest,
    AllocateSlots,
    AllocateSteps,
    AllocationReply,
    AppendTokens,
    CheckManager,
    EventsReply,
    FinishStep,
    FreeRequest,
    GetManagerStats,
    GetPrefillCost,
    ManagerStatsReply,
    MarkComputed,
    PreemptRequest,
    PrefillCostReply,
    StepsReply,
    TakeEvents,
)
from kvpool.manager.types import (
    Allocation,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepUpdate,
)
from kvpool.manager.validation import check_count, check_timestamp
from kvpool.pool import BlockPool

_TAKE_EVENTS = TakeEvents()
_GET_STATS = GetManagerStats()
_CHECK = CheckManager()


class ManagerClient:
    """The handle `open_manager` yields; usable from any task on the actor's loop.

    Every method is one actor call, always a checkpoint, and raises what the
    `KvManager` method of the same name raises (a `kvpool.errors.PoolError`, nothing
    changed), or `PoolClosedError` / `PoolCrashedError` once the actor is gone. What
    cancellation does to each call: `kvpool.manager.handlers`, under the contract in
    `kvpool.actors`.
    """

    __slots__ = ("_call", "block_size", "capacity")

    def __init__(self, actor: Actor, capacity: int, block_size: int) -> None:
        self._call = actor.call
        self.capacity = capacity
        """Blocks in the pool."""
        self.block_size = block_size
        """Tokens per block."""

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> PrefillCost:
        """Register a request with its prompt; returns its prefill cost now.

        Raises `DuplicateRequestError`, `InvalidArgumentError`.
        """
        reply: PrefillCostReply = await self._call(
            AddRequest(request_id, prompt_token_ids)  # type: ignore[arg-type]
        )
        return reply.cost

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append decoded tokens to a request; returns None.

        Raises `UnknownRequestError`, `InvalidArgumentError`.
        """
        await self._call(AppendTokens(request_id, token_ids))  # type: ignore[arg-type]

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        """Return what the request's next allocation of all its tokens needs now.

        Raises `UnknownRequestError`.
        """
        reply: PrefillCostReply = await self._call(GetPrefillCost(request_id))
        return reply.cost

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        wait: bool = False,
        cache: bool = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        """Grow the request's table to hold ``num_tokens``; return the `Allocation`.

        Returns None when it does not fit now (nothing changed but ``new_tokens``
        appended), unless ``wait``: then the call queues FIFO behind earlier waiters and
        returns once it fits. With ``cache``, the allocated tokens are also marked
        computed, making the full blocks they cover visible; ``new_tokens`` are appended
        first, in the same turn (`KvManager.allocate`; not with ``wait``). Raises
        `UnknownRequestError`, `TokenCountError`, `InvalidArgumentError`, and
        `CapacityError` when it could never fit.
        """
        reply: AllocationReply = await self._call(
            AllocateSlots(request_id, num_tokens, wait, cache, new_tokens)  # type: ignore[arg-type]
        )
        return reply.allocation

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        """One or more steps' allocations, in order, stopping at the first that does not
        fit (or after the first that changes the probe's cost from
        ``stop_if_cost_changes``), each step's events and counters read after it, and
        the probed request's prefill cost after the last, in one turn
        (`KvManager.allocate_steps`). Raises what it raises, before anything changes."""
        reply: StepsReply = await self._call(
            AllocateSteps(steps, probe, stop_if_cost_changes)  # type: ignore[arg-type]
        )
        return reply.steps

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Record the computed-token count, making covered full blocks visible.

        Raises `UnknownRequestError`, `TokenCountError`, `InvalidArgumentError`.
        """
        await self._call(MarkComputed(request_id, num_computed_tokens))

    async def free(self, request_id: str) -> None:
        """Completion: release the request's blocks leaf first and forget it.

        Raises `UnknownRequestError` (a double free included).
        """
        await self._call(FreeRequest(request_id))

    async def preempt(self, request_id: str) -> None:
        """Release the request's blocks leaf first, keeping it for re-admission.

        Raises `UnknownRequestError`.
        """
        await self._call(PreemptRequest(request_id))

    async def finish_step(self, updates: list[StepUpdate], probe: str | None = None) -> StepOutcome:
        """Apply a step's updates, drain the events, read occupancy, counters and the
        probe's prefill cost, in one turn; return the `StepOutcome`. Raises as
        `KvManager.finish_step`."""
        outcome: StepOutcome = await self._call(FinishStep(updates, probe))
        return outcome

    async def take_events(self) -> list[KVEvent]:
        """Drain and return the queued KV events, oldest first."""
        reply: EventsReply = await self._call(_TAKE_EVENTS)
        return reply.events

    async def take_batch(
        self, ts: float | None = None, data_parallel_rank: int | None = None
    ) -> KVEventBatch | None:
        """Drain the queued events into one `KVEventBatch` (``ts`` defaults to now);
        None if there were none. Raises `InvalidArgumentError` for a ``ts`` that is not
        a finite float or a rank that is not None or an int >= 0, before any event is
        taken (as `KvManager.take_batch`)."""
        try:
            stamp = time.time() if ts is None else check_timestamp(ts)
            if data_parallel_rank is not None:
                check_count(data_parallel_rank, "data_parallel_rank")
        except InvalidArgumentError:
            await anyio.lowlevel.checkpoint()  # a refused call yields too
            raise
        events = await self.take_events()
        if not events:
            return None
        return KVEventBatch(ts=stamp, events=events, data_parallel_rank=data_parallel_rank)

    async def stats(self) -> ManagerStats:
        """Return the manager's counters."""
        reply: ManagerStatsReply = await self._call(_GET_STATS)
        return reply.stats

    async def usage(self) -> PoolUsage:
        """Return the pool's occupancy."""
        reply: ManagerStatsReply = await self._call(_GET_STATS)
        return PoolUsage(reply.num_active, reply.num_inactive, reply.capacity)

    async def check_invariants(self) -> None:
        """Re-derive the manager's and the pool's invariants; a breach crashes the actor
        (this call and every later one raise `PoolCrashedError`).
        """
        await self._call(_CHECK)


@asynccontextmanager
async def open_manager(
    capacity: int,
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    enable_kv_cache_events: bool = True,
    medium: str | None = "GPU",
    on_create: Callable[[KvManager], None] | None = None,
) -> AsyncIterator[ManagerClient]:
    """Start an actor owning ``BlockPool(capacity)`` and a `KvManager` over it; yield
    its `ManagerClient`.

    ``on_create`` receives the manager as it is built (to inspect it; drive it only
    through the client). Raises `InvalidArgumentError` for a bad argument, before any
    task starts. Life cycle and exceptions are `kvpool.actors.open_actor`'s.
    """
    manager = KvManager(
        BlockPool(capacity),
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        medium=medium,
    )
    if on_create is not None:
        on_create(manager)
    async with open_actor(ManagerHandlers(manager).table()) as actor:
        yield ManagerClient(actor, capacity, block_size)


interrupt_safe(open_manager.__wrapped__)  # type: ignore[attr-defined]

__all__ = ["ManagerClient", "open_manager"]
