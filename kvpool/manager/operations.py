"""The manager service: `ManagerState` (a `KvManager` over a pool nothing else touches)
and `OPERATIONS`, one declaration per message kind of `kvpool.manager.messages` (the
layout every service follows: `kvpool.actors.operation`).

The manager actor, or the inline transport, runs them and owns both the manager and its
pool: no pool-level mutation is exposed beside the manager's own calls, so a block table
can never be changed behind the manager's back.

What each kind does under cancellation (the contract: `kvpool.actors`):
- `AllocateSlots` hands blocks out: undone by `KvManager.undo_allocation` (released
  leaf first, computed count clipped). A BlockRemoved for what its reserve evicted
  stays queued, as those hashes really are gone.
- `AllocateSteps` and `AllocateStretch` hand blocks and events out: each allocation of
  each step undone as `AllocateSlots`'s, last first, then the steps' events put back
  ahead of newer ones.
- `TakeEvents` and `TakeBatch` hand events out: undone by putting them back ahead of
  newer ones.
- `TakeEvents`, `TakeBatch`, `FinishStep`, `FinishStretch`, `AllocateSteps`,
  `ScheduleStep`, `ScheduleAfterChain` and `AllocateStretch` are ``ordered``: the actor
  serves one only after every earlier one's reply was read or undone, so putting
  events back never lands them behind newer events another drainer already took.
- `AddRequest`: undone by forgetting the request again while it holds no block.
- `ScheduleStep` hands blocks and events out (and may register requests): each
  allocation undone as `AllocateSlots`'s, last first, the requests it registered
  forgotten again, then the run it carried (if any) undone as `AllocateRun`'s, and the
  events put back ahead of newer ones.
- `ScheduleAfterChain` (a `ScheduleStep` carrying a chain) gives blocks back too: it runs
  even if its caller left, as `FinishChain` does; an unread reply's step is undone as
  `ScheduleStep`'s, then its chain's allocations as `FinishChain`'s.
- `FreeRequest`, `PreemptRequest` and `FinishStep` give blocks back: they run even if
  their caller left; an unread `FinishStep` reply's events are put back.
- `FinishStretch` gives blocks back too (its frees run even if its caller left) and
  hands blocks and events out: an unread reply's allocations are undone as
  `AllocateStretch`'s (a freed request's are gone with it), and its events put back.
  `FinishRun` and `FinishChain` likewise, a chain's events put back in the order its
  segments queued them.
- `AppendTokens`, `MarkComputed` and an `AllocateSlots`' ``new_tokens`` took effect if
  the actor reached them (the computed
  count is a watermark, so re-sending it is harmless).
"""

from __future__ import annotations

import time
from typing import Any

from kvpool.actors import WAIT, Handler, Wait
from kvpool.actors.operation import Operation, handler_table
from kvpool.errors import InvalidArgumentError
from kvpool.events import KVEvent
from kvpool.manager import KvManager
from kvpool.manager.messages import (
    AddRequest,
    AllocateRun,
    AllocateSlots,
    AllocateSteps,
    AllocateStretch,
    AllocationReply,
    AppendTokens,
    BatchReply,
    CheckManager,
    EventsReply,
    FinishChain,
    FinishRun,
    FinishStep,
    FinishStretch,
    FreeRequest,
    GetManagerStats,
    GetPrefillCost,
    ManagerStatsReply,
    MarkComputed,
    PreemptRequest,
    PrefillCostReply,
    RunFinished,
    ScheduleAfterChain,
    ScheduleStep,
    StepsReply,
    StretchFinished,
    TakeBatch,
    TakeEvents,
)
from kvpool.manager.types import (
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    PoolUsage,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepOutcome,
    StepSchedule,
    StretchAllocations,
)
from kvpool.messages import DoneReply

_DONE = DoneReply()
_NO_ROOM = AllocationReply(None)


class ManagerState:
    """What the manager service owns: its `KvManager` (and, through it, the pool).

    Its methods are the handlers `OPERATIONS` names; only the actor (or the inline
    transport) calls them.
    """

    __slots__ = ("manager",)

    def __init__(self, manager: KvManager) -> None:
        self.manager = manager

    def table(self) -> dict[type[Any], Handler[Any, Any]]:
        """The handler table of `OPERATIONS` over this state."""
        return handler_table(OPERATIONS, self)

    def allocate(self, message: AllocateSlots) -> AllocationReply | Wait:
        if message.new_tokens and message.wait:
            raise InvalidArgumentError(
                "new_tokens cannot ride on a waiting allocation (it is retried): append them first"
            )
        allocation = self.manager.allocate(
            message.request_id,
            message.num_tokens,
            cache=message.cache,
            new_tokens=message.new_tokens,
        )
        if allocation is None:
            return WAIT if message.wait else _NO_ROOM
        return AllocationReply(allocation)

    def undo_allocate(self, message: AllocateSlots, reply: AllocationReply) -> None:
        if reply.allocation is not None:
            self.manager.undo_allocation(message.request_id, reply.allocation)

    def allocate_steps(self, message: AllocateSteps) -> StepsReply:
        return StepsReply(
            self.manager.allocate_steps(
                message.steps, message.probe, stop_if_cost_changes=message.stop_if_cost_changes
            )
        )

    def undo_allocate_steps(self, message: AllocateSteps, reply: StepsReply) -> None:
        manager = self.manager
        done = [
            (slot.request_id, allocation)
            for slots, step in zip(message.steps, reply.steps, strict=False)
            for slot, allocation in zip(slots, step.allocations, strict=False)
        ]
        for request_id, allocation in reversed(done):  # last in, first out
            manager.undo_allocation(request_id, allocation)
        manager.restore_events([event for step in reply.steps for event in step.events])

    def schedule(self, message: ScheduleStep) -> StepSchedule:
        return self.manager.schedule(message.slots, message.queue, message.gate, message.run)

    def undo_schedule(self, message: ScheduleStep, reply: StepSchedule) -> None:
        """The step's allocations last first, its registrations, then the carried run's
        (`_undo_run`), the events put back in the order they were drained."""
        self._undo_step(message.slots, message.queue, reply)
        carried = reply.run
        if message.run is not None and type(carried) is RunAllocations:
            self._undo_run(message.run, carried, reply.step.events)
        else:
            self.manager.restore_events(reply.step.events)

    def schedule_after_chain(self, message: ScheduleAfterChain) -> StepSchedule:
        return self.manager.schedule(message.slots, message.queue, message.gate, message.chain)

    def undo_schedule_after_chain(self, message: ScheduleAfterChain, reply: StepSchedule) -> None:
        """The step's allocations and registrations as `undo_schedule`'s, then the
        chain's as `undo_finish_chain`'s (its frees stay made: a give-back), the events
        put back in the order they were drained."""
        self._undo_step(message.slots, message.queue, reply)
        carried = reply.run
        assert type(carried) is ChainAllocations  # the chain is made before the step
        self._undo_chain(message.chain, carried, reply.step.events)

    def _undo_step(
        self, slots: list[SlotRequest], queue: list[QueuedRequest], reply: StepSchedule
    ) -> None:
        """Undo a scheduled step's allocations, last first, and forget the requests it
        registered."""
        manager = self.manager
        allocations = reply.step.allocations
        fit = len(allocations) - len(reply.costs)  # the slots' allocations come first
        ids = [slot.request_id for slot in slots[:fit]]
        ids += [queued.request_id for queued in queue[: len(reply.costs)]]
        for request_id, allocation in reversed(list(zip(ids, allocations, strict=True))):
            manager.undo_allocation(request_id, allocation)
        for queued in queue:
            if queued.prompt_token_ids is not None:
                self._forget(queued.request_id)

    def allocate_stretch(self, message: AllocateStretch) -> StretchAllocations:
        return self.manager.allocate_stretch(
            message.stretch, message.probe, stop_if_cost_changes=message.stop_if_cost_changes
        )

    def undo_allocate_stretch(self, message: AllocateStretch, reply: StretchAllocations) -> None:
        self._undo_stretch(message.stretch, reply, [])

    def finish_stretch(self, message: FinishStretch) -> StretchFinished:
        allocations, outcome = self.manager.finish_stretch(message.stretch, message.updates)
        return StretchFinished(allocations, outcome)

    def undo_finish_stretch(self, message: FinishStretch, reply: StretchFinished) -> None:
        self._undo_stretch(message.stretch, reply.allocations, reply.outcome.events)

    def _undo_stretch(
        self, stretch: DecodeStretch, reply: StretchAllocations, later: list[KVEvent]
    ) -> None:
        """Undo a stretch's allocations, last first, then put its events back, and
        ``later`` ones (drained after it) behind them."""
        manager = self.manager
        for k in range(len(reply.allocations) - 1, -1, -1):  # last in, first out
            request_id = stretch.request_ids[stretch.members[k]]
            manager.undo_allocation(request_id, reply.allocations[k])
        events = [event for _, events in reply.events for event in events]
        manager.restore_events(events + later if later else events)

    def allocate_run(self, message: AllocateRun) -> RunAllocations:
        return self.manager.allocate_run(
            message.run, message.probe, stop_if_cost_changes=message.stop_if_cost_changes
        )

    def undo_allocate_run(self, message: AllocateRun, reply: RunAllocations) -> None:
        self._undo_run(message.run, reply, [])

    def finish_run(self, message: FinishRun) -> RunFinished:
        allocations, outcome = self.manager.finish_run(message.run, message.updates)
        return RunFinished(allocations, outcome)

    def undo_finish_run(self, message: FinishRun, reply: RunFinished) -> None:
        self._undo_run(message.run, reply.allocations, reply.outcome.events)

    def finish_chain(self, message: FinishChain) -> ChainAllocations:
        return self.manager.finish_chain(message.chain)

    def undo_finish_chain(self, message: FinishChain, reply: ChainAllocations) -> None:
        self._undo_chain(message.chain, reply, [])

    def _undo_chain(
        self, chain: DecodeChain, reply: ChainAllocations, later: list[KVEvent]
    ) -> None:
        """Undo a chain's allocations (a freed request's are back already), then put its
        events back in the order they were queued (each leave's after its groups'), and
        ``later`` ones (drained after it) behind them."""
        manager = self.manager
        run = chain.run
        allocations = reply.run.allocations
        for i in range(len(allocations) - 1, -1, -1):
            manager.undo_allocation(run.request_ids[i], allocations[i])
        events: list[KVEvent] = []
        group_events = reply.run.events
        pending = 0
        for j, outcome in enumerate(reply.outcomes):
            while pending < len(group_events) and group_events[pending][0] < reply.groups[j]:
                events.extend(group_events[pending][1])
                pending += 1
            events.extend(outcome.events)
        for _, queued in group_events[pending:]:
            events.extend(queued)
        manager.restore_events(events + later if later else events)

    def _undo_run(self, run: DecodeRun, reply: RunAllocations, later: list[KVEvent]) -> None:
        """Undo a run's allocations, request by request, last first, then put its events
        back, and ``later`` ones (drained after it) behind them."""
        manager = self.manager
        for i in range(len(reply.allocations) - 1, -1, -1):
            manager.undo_allocation(run.request_ids[i], reply.allocations[i])
        events = [event for _, events in reply.events for event in events]
        manager.restore_events(events + later if later else events)

    def mark_computed(self, message: MarkComputed) -> DoneReply:
        self.manager.mark_computed(message.request_id, message.num_computed_tokens)
        return _DONE

    def append_tokens(self, message: AppendTokens) -> DoneReply:
        self.manager.append_tokens(message.request_id, message.token_ids)
        return _DONE

    def add_request(self, message: AddRequest) -> PrefillCostReply:
        return PrefillCostReply(
            self.manager.add_request(message.request_id, message.prompt_token_ids)
        )

    def undo_add_request(self, message: AddRequest, reply: PrefillCostReply) -> None:
        self._forget(message.request_id)

    def _forget(self, request_id: str) -> None:
        """Forget a request an unread reply registered, while it holds no block."""
        manager = self.manager
        if request_id in manager and not manager.num_blocks(request_id):
            manager.free(request_id)

    def free(self, message: FreeRequest) -> DoneReply:
        self.manager.free(message.request_id)
        return _DONE

    def preempt(self, message: PreemptRequest) -> DoneReply:
        self.manager.preempt(message.request_id)
        return _DONE

    def finish_step(self, message: FinishStep) -> StepOutcome:
        return self.manager.finish_step(message.updates, message.probe)

    def undo_finish_step(self, message: FinishStep, reply: StepOutcome) -> None:
        self.manager.restore_events(reply.events)

    def prefill_cost(self, message: GetPrefillCost) -> PrefillCostReply:
        return PrefillCostReply(self.manager.prefill_cost(message.request_id))

    def take_events(self, message: TakeEvents) -> EventsReply:
        return EventsReply(self.manager.take_events())

    def undo_take_events(self, message: TakeEvents, reply: EventsReply) -> None:
        self.manager.restore_events(reply.events)

    def take_batch(self, message: TakeBatch) -> BatchReply:
        ts = time.time() if message.ts is None else message.ts
        return BatchReply(self.manager.take_batch(ts, message.data_parallel_rank))

    def undo_take_batch(self, message: TakeBatch, reply: BatchReply) -> None:
        if reply.batch is not None:
            self.manager.restore_events(reply.batch.events)

    def stats(self, message: GetManagerStats) -> ManagerStatsReply:
        pool = self.manager.pool
        usage = PoolUsage(pool.num_active(), pool.num_inactive(), pool.capacity)
        return ManagerStatsReply(self.manager.stats(), usage)

    def check_invariants(self, message: CheckManager) -> DoneReply:
        self.manager.check_invariants()
        return _DONE


def _waits(message: AllocateSlots) -> bool:
    return message.wait


OPERATIONS: tuple[Operation[ManagerState, Any, Any], ...] = (
    Operation(
        AllocateSlots,
        AllocationReply,
        ManagerState.allocate,
        undo=ManagerState.undo_allocate,
        waits=_waits,
    ),
    Operation(
        AllocateSteps,
        StepsReply,
        ManagerState.allocate_steps,
        undo=ManagerState.undo_allocate_steps,
        ordered=True,
    ),
    Operation(
        ScheduleStep,
        StepSchedule,
        ManagerState.schedule,
        undo=ManagerState.undo_schedule,
        ordered=True,
    ),
    Operation(
        ScheduleAfterChain,
        StepSchedule,
        ManagerState.schedule_after_chain,
        undo=ManagerState.undo_schedule_after_chain,
        gives_back=True,
        ordered=True,
    ),
    Operation(
        AllocateStretch,
        StretchAllocations,
        ManagerState.allocate_stretch,
        undo=ManagerState.undo_allocate_stretch,
        ordered=True,
    ),
    Operation(
        AllocateRun,
        RunAllocations,
        ManagerState.allocate_run,
        undo=ManagerState.undo_allocate_run,
        ordered=True,
    ),
    Operation(MarkComputed, DoneReply, ManagerState.mark_computed),
    Operation(AppendTokens, DoneReply, ManagerState.append_tokens),
    Operation(
        AddRequest, PrefillCostReply, ManagerState.add_request, undo=ManagerState.undo_add_request
    ),
    Operation(FreeRequest, DoneReply, ManagerState.free, gives_back=True),
    Operation(PreemptRequest, DoneReply, ManagerState.preempt, gives_back=True),
    Operation(
        FinishStep,
        StepOutcome,
        ManagerState.finish_step,
        undo=ManagerState.undo_finish_step,
        gives_back=True,
        ordered=True,
    ),
    Operation(
        FinishStretch,
        StretchFinished,
        ManagerState.finish_stretch,
        undo=ManagerState.undo_finish_stretch,
        gives_back=True,
        ordered=True,
    ),
    Operation(
        FinishRun,
        RunFinished,
        ManagerState.finish_run,
        undo=ManagerState.undo_finish_run,
        gives_back=True,
        ordered=True,
    ),
    Operation(
        FinishChain,
        ChainAllocations,
        ManagerState.finish_chain,
        undo=ManagerState.undo_finish_chain,
        gives_back=True,
        ordered=True,
    ),
    Operation(GetPrefillCost, PrefillCostReply, ManagerState.prefill_cost),
    Operation(
        TakeEvents,
        EventsReply,
        ManagerState.take_events,
        undo=ManagerState.undo_take_events,
        ordered=True,
    ),
    Operation(
        TakeBatch,
        BatchReply,
        ManagerState.take_batch,
        undo=ManagerState.undo_take_batch,
        ordered=True,
    ),
    Operation(GetManagerStats, ManagerStatsReply, ManagerState.stats),
    Operation(CheckManager, DoneReply, ManagerState.check_invariants),
)
"""The manager protocol, one `Operation` per request kind."""

__all__ = ["OPERATIONS", "ManagerState"]
