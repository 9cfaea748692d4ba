"""The manager service's one client, `ManagerClient`, over a transport of three.

The client's methods are `KvManager`'s, awaited: each builds its request Struct
(`kvpool.manager.messages`), hands it to its transport and unpacks the reply; what each
one returns and raises is what the `KvManager` method of the same name does (a
`kvpool.errors.PoolError` that changed nothing). The transport decides where the handler
(`kvpool.manager.operations`) runs:

- `InlineTransport`: in the caller's task, at once. No call ever yields to the event
  loop, so an engine step is atomic with respect to other tasks and cancellation cannot
  interrupt a call half-way. An ``allocate(wait=True)`` that does not fit raises
  `CannotWaitError` (nothing changed): no other task could give blocks back while the
  caller's own task is the one running the manager.
- the manager actor (`open_manager`, `kvpool.actors.Actor.call`): one task owns the
  manager, so calls from any number of tasks are serialized, each one atomic, and the
  router-visible events leave in the order the actor produced them. Every call is a
  checkpoint and follows the cancellation contract of `kvpool.actors`; once the actor
  is gone calls raise `ManagerClosedError` / `ManagerCrashedError`.
- `TimedTransport`: another transport, adding up the wall time spent in each call and
  the number of calls (benchmarks split wall time between the cache and the scheduler).

`ManagerClient` is the engine's KV client (`kvpool.engine.KvClient`). Example::

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
from typing import Any, Final, Protocol

from kvpool.actors import WAIT, ActorIdentity, open_actor
from kvpool.actors.slots import interrupt_safe
from kvpool.errors import (
    CannotWaitError,
    InvalidArgumentError,
    ManagerClosedError,
    ManagerCrashedError,
)
from kvpool.events import KVEvent, KVEventBatch
from kvpool.manager import KvManager, messages
from kvpool.manager.operations import ManagerState
from kvpool.manager.types import (
    AdmissionGate,
    Allocation,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepSchedule,
    StepUpdate,
    StretchAllocations,
)
from kvpool.pool import BlockPool

MANAGER_ACTOR: Final = ActorIdentity("manager actor", ManagerClosedError, ManagerCrashedError)
"""The actor `open_manager` runs."""

_TAKE_EVENTS = messages.TakeEvents()
_GET_STATS = messages.GetManagerStats()
_CHECK = messages.CheckManager()


class Transport(Protocol):
    """Carries one request to the manager's handler and returns its reply."""

    async def call(self, message: Any) -> Any:
        """The reply of ``message``'s handler; raises what it raised."""
        ...


class InlineTransport:
    """Runs each handler in the caller's task, without yielding (module docstring)."""

    __slots__ = ("_table", "manager")

    def __init__(self, manager: KvManager) -> None:
        self.manager = manager
        """The manager the handlers drive (the caller's own: inspect it freely)."""
        self._table = ManagerState(manager).table()

    async def call(self, message: Any) -> Any:
        handler = self._table.get(type(message))
        if handler is None:
            raise InvalidArgumentError(f"no handler for message {message!r}")
        reply = handler.handle(message)
        if reply is WAIT:
            raise CannotWaitError(
                f"{message!r:.200} does not fit and an inline client cannot wait for room"
            )
        return reply


class TimedTransport:
    """Another transport, adding the wall time spent in each call to ``seconds`` and
    counting ``calls``."""

    __slots__ = ("_inner", "calls", "seconds")

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.seconds = 0.0
        self.calls = 0

    async def call(self, message: Any) -> Any:
        start = time.perf_counter()
        try:
            return await self._inner.call(message)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class ManagerClient:
    """The manager service's client over one `Transport` (module docstring: what each
    transport does to a call); usable from any task on the transport's loop."""

    __slots__ = ("_call", "block_size", "capacity", "transport")

    def __init__(self, transport: Transport, capacity: int, block_size: int) -> None:
        self.transport = transport
        self._call = transport.call
        self.capacity = capacity
        """Blocks in the pool."""
        self.block_size = block_size
        """Tokens per block."""

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> PrefillCost:
        """`KvManager.add_request`: register a request; returns its prefill cost now."""
        reply: messages.PrefillCostReply = await self._call(
            messages.AddRequest(request_id, prompt_token_ids)  # type: ignore[arg-type]
        )
        return reply.cost

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """`KvManager.append_tokens`: decoded tokens join the request."""
        await self._call(messages.AppendTokens(request_id, token_ids))  # type: ignore[arg-type]

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        """`KvManager.prefill_cost`: what an allocation of all its tokens needs now."""
        reply: messages.PrefillCostReply = await self._call(messages.GetPrefillCost(request_id))
        return reply.cost

    async def schedule(
        self,
        slots: list[SlotRequest],
        queue: list[QueuedRequest],
        gate: AdmissionGate,
        run: DecodeRun | DecodeChain | None = None,
    ) -> StepSchedule:
        """`KvManager.schedule`: a carried decode run (or chain), a step's running slots
        and its admissions in one call (a chain's is a `ScheduleAfterChain`: a
        give-back, made even if the caller leaves)."""
        message: messages.ScheduleStep | messages.ScheduleAfterChain
        if isinstance(run, DecodeChain):
            message = messages.ScheduleAfterChain(run, slots, queue, gate)
        else:
            message = messages.ScheduleStep(slots, queue, gate, run)
        reply: StepSchedule = await self._call(message)
        return reply

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        wait: bool = False,
        cache: bool = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        """`KvManager.allocate`: grow the table to ``num_tokens``; None if it does not fit.

        With ``wait`` (not with ``new_tokens``) a call that does not fit queues FIFO
        behind earlier waiters of the actor and returns once it fits; inline it raises
        `CannotWaitError`. Raises `CapacityError` when it could never fit.
        """
        reply: messages.AllocationReply = await self._call(
            messages.AllocateSlots(request_id, num_tokens, wait, cache, new_tokens)  # type: ignore[arg-type]
        )
        return reply.allocation

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        """`KvManager.allocate_steps`: one or more steps' allocations in one call."""
        reply: messages.StepsReply = await self._call(
            messages.AllocateSteps(steps, probe, stop_if_cost_changes)  # type: ignore[arg-type]
        )
        return reply.steps

    async def allocate_stretch(
        self,
        stretch: DecodeStretch,
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> StretchAllocations:
        """`KvManager.allocate_stretch`: a decode stretch's allocations in one call."""
        reply: StretchAllocations = await self._call(
            messages.AllocateStretch(stretch, probe, stop_if_cost_changes)
        )
        return reply

    async def allocate_run(
        self,
        run: DecodeRun,
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> RunAllocations:
        """`KvManager.allocate_run`: a decode run's allocations in closed form."""
        reply: RunAllocations = await self._call(
            messages.AllocateRun(run, probe, stop_if_cost_changes)
        )
        return reply

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """`KvManager.mark_computed`: move the visibility watermark."""
        await self._call(messages.MarkComputed(request_id, num_computed_tokens))

    async def free(self, request_id: str) -> None:
        """`KvManager.free`: completion; release leaf first and forget the request."""
        await self._call(messages.FreeRequest(request_id))

    async def preempt(self, request_id: str) -> None:
        """`KvManager.preempt`: release leaf first, keeping the request's tokens."""
        await self._call(messages.PreemptRequest(request_id))

    async def finish_step(self, updates: list[StepUpdate], probe: str | None = None) -> StepOutcome:
        """`KvManager.finish_step`: a step's updates, the drain and the reads, in one call."""
        outcome: StepOutcome = await self._call(messages.FinishStep(updates, probe))
        return outcome

    async def finish_stretch(
        self, stretch: DecodeStretch, updates: list[StepUpdate]
    ) -> tuple[StretchAllocations, StepOutcome]:
        """`KvManager.finish_stretch`: a stretch's allocations, then a step's updates."""
        reply: messages.StretchFinished = await self._call(messages.FinishStretch(stretch, updates))
        return reply.allocations, reply.outcome

    async def finish_run(
        self, run: DecodeRun, updates: list[StepUpdate]
    ) -> tuple[RunAllocations, StepOutcome]:
        """`KvManager.finish_run`: a run's allocations, then a step's updates."""
        reply: messages.RunFinished = await self._call(messages.FinishRun(run, updates))
        return reply.allocations, reply.outcome

    async def finish_chain(self, chain: DecodeChain) -> ChainAllocations:
        """`KvManager.finish_chain`: decode steps with their finishing requests' frees."""
        reply: ChainAllocations = await self._call(messages.FinishChain(chain))
        return reply

    async def take_events(self) -> list[KVEvent]:
        """`KvManager.take_events`: the queued KV events, oldest first."""
        reply: messages.EventsReply = await self._call(_TAKE_EVENTS)
        return reply.events

    async def take_batch(
        self, ts: float | None = None, data_parallel_rank: int | None = None
    ) -> KVEventBatch | None:
        """`KvManager.take_batch`, ``ts`` defaulting to the wall clock as it is served."""
        reply: messages.BatchReply = await self._call(messages.TakeBatch(ts, data_parallel_rank))
        return reply.batch

    async def stats(self) -> ManagerStats:
        """`KvManager.stats`: the manager's counters."""
        reply: messages.ManagerStatsReply = await self._call(_GET_STATS)
        return reply.stats

    async def usage(self) -> PoolUsage:
        """The pool's occupancy now."""
        reply: messages.ManagerStatsReply = await self._call(_GET_STATS)
        return reply.usage

    async def check_invariants(self) -> None:
        """`KvManager.check_invariants` (the pool's too); through an actor, a breach
        crashes it (this call and every later one raise `ManagerCrashedError`)."""
        await self._call(_CHECK)


class LocalKvClient(ManagerClient):
    """A `ManagerClient` over the `InlineTransport` of a `KvManager` the caller owns."""

    __slots__ = ()

    def __init__(self, manager: KvManager) -> None:
        super().__init__(
            InlineTransport(manager), capacity=manager.pool.capacity, block_size=manager.block_size
        )

    @classmethod
    def create(
        cls,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = True,
        run_keys: bool = False,
    ) -> LocalKvClient:
        """A client over a fresh pool of ``num_gpu_blocks`` blocks and its own manager
        (``run_keys``: `KvManager`'s)."""
        manager = KvManager(
            BlockPool(num_gpu_blocks),
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            run_keys=run_keys,
        )
        return cls(manager)

    @property
    def manager(self) -> KvManager:
        """The manager this client drives."""
        transport: InlineTransport = self.transport  # type: ignore[assignment]
        return transport.manager


class TimedKvClient(ManagerClient):
    """A `ManagerClient` over a `TimedTransport` wrapping ``inner``'s transport."""

    __slots__ = ()

    def __init__(self, inner: ManagerClient) -> None:
        super().__init__(
            TimedTransport(inner.transport), capacity=inner.capacity, block_size=inner.block_size
        )

    @property
    def seconds(self) -> float:
        """Wall time spent in calls so far."""
        return self._timer().seconds

    @property
    def calls(self) -> int:
        """Calls made so far."""
        return self._timer().calls

    def _timer(self) -> TimedTransport:
        timer: TimedTransport = self.transport  # type: ignore[assignment]
        return timer


@asynccontextmanager
async def open_manager(
    capacity: int,
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    enable_kv_cache_events: bool = True,
    medium: str | None = "GPU",
    run_keys: bool = False,
    on_create: Callable[[KvManager], None] | None = None,
) -> AsyncIterator[ManagerClient]:
    """Start the manager actor owning ``BlockPool(capacity)`` and a `KvManager` over it;
    yield its `ManagerClient` (``run_keys``: `KvManager`'s).

    ``on_create`` receives the manager as it is built (to inspect it; drive it only
    through the client). Raises `InvalidArgumentError` for a bad argument, before any
    task starts. Life cycle and exceptions are `kvpool.actors.open_actor`'s, with
    `ManagerClosedError` / `ManagerCrashedError`.
    """
    manager = KvManager(
        BlockPool(capacity),
        block_size,
        enable_prefix_caching=enable_prefix_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        medium=medium,
        run_keys=run_keys,
    )
    if on_create is not None:
        on_create(manager)
    async with open_actor(ManagerState(manager).table(), identity=MANAGER_ACTOR) as actor:
        yield ManagerClient(actor, capacity=capacity, block_size=block_size)


interrupt_safe(open_manager.__wrapped__)  # type: ignore[attr-defined]

__all__ = [
    "MANAGER_ACTOR",
    "InlineTransport",
    "LocalKvClient",
    "ManagerClient",
    "TimedKvClient",
    "TimedTransport",
    "Transport",
    "open_manager",
]
