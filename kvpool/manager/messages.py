"""The manager service's protocol: one tagged msgspec Struct per request and reply kind.

Each kind's handler, undo and flags are declared beside it in
`kvpool.manager.operations` (the layout every service follows: `kvpool.actors.operation`).

Wire-ready like the pool's (`kvpool.messages`): requests name a request by its id and
carry plain ints and token lists, replies carry the manager's value types, and every
kind round-trips through `encode` / `decode`. Tags are distinct from the pool
protocol's, so both can share one mailbox (and one wire union).
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvpool.events import KVEvent, KVEventBatch
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
from kvpool.messages import DoneReply, ErrorReply


class AddRequest(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.add_request``: register ``request_id`` with its prompt; the reply is
    a `PrefillCostReply` (its cost now)."""

    request_id: str
    prompt_token_ids: list[int]


class ScheduleStep(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.schedule``: the decode ``run`` jumped over before the step, if any,
    then a step's running slots, then its admissions from ``queue`` while ``gate`` lets
    them in, in one call; the reply is a `StepSchedule`."""

    slots: list[SlotRequest]
    queue: list[QueuedRequest]
    gate: AdmissionGate
    run: DecodeRun | None = None


class ScheduleAfterChain(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.schedule`` carrying a ``chain`` of jumps that finished requests
    (`ScheduleStep`'s ``run``, a `DecodeChain`): the chain, then the step's slots and
    admissions, the gate's headroom counted before the chain's frees. A give-back, as
    `FinishChain` is; the reply is a `StepSchedule`."""

    chain: DecodeChain
    slots: list[SlotRequest]
    queue: list[QueuedRequest]
    gate: AdmissionGate


class AppendTokens(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.append_tokens``: decoded tokens join the request."""

    request_id: str
    token_ids: list[int]


class GetPrefillCost(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.prefill_cost`` of ``request_id``."""

    request_id: str


class AllocateSlots(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.allocate``: grow the table to hold ``num_tokens`` tokens.

    With ``wait`` a request that does not fit yet joins the actor's FIFO of waiters and
    is granted once capacity allows, instead of getting None. With ``cache`` the
    allocated tokens are also marked computed (vLLM's ``allocate_slots``).
    ``new_tokens`` are appended first (not with ``wait``: a waiter is retried).
    """

    request_id: str
    num_tokens: int
    wait: bool = False
    cache: bool = False
    new_tokens: list[int] = []


class AllocateSteps(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.allocate_steps``: one or more steps' allocations, in order, each
    step's events drained and counters read after it and, with ``probe``, a request's
    prefill cost after the last (or after the first step that changed it from
    ``stop_if_cost_changes``); the reply is a `StepsReply`."""

    steps: list[list[SlotRequest]]
    probe: str | None = None
    stop_if_cost_changes: PrefillCost | None = None


class AllocateStretch(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.allocate_stretch``: a decode stretch's allocations in compact form;
    the reply is a `StretchAllocations`."""

    stretch: DecodeStretch
    probe: str | None = None
    stop_if_cost_changes: PrefillCost | None = None


class AllocateRun(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.allocate_run``: a decode run's allocations in closed form; the reply
    is a `RunAllocations`."""

    run: DecodeRun
    probe: str | None = None
    stop_if_cost_changes: PrefillCost | None = None


class MarkComputed(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.mark_computed``: the scheduler's computed-token count."""

    request_id: str
    num_computed_tokens: int


class FreeRequest(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.free``: completion; release leaf first and forget the request."""

    request_id: str


class PreemptRequest(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.preempt``: release leaf first and keep the request's tokens."""

    request_id: str


class TakeEvents(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.take_events``: drain the queued KV events, oldest first."""


class TakeBatch(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.take_batch``: drain the queued events into one `KVEventBatch` stamped
    ``ts`` (None: the wall clock as the call is served), or None if there were none."""

    ts: float | None = None
    data_parallel_rank: int | None = None


class FinishStep(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.finish_step``: a scheduler step's updates, then the drain and reads
    and, with ``probe``, that request's prefill cost."""

    updates: list[StepUpdate]
    probe: str | None = None


class FinishStretch(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.finish_stretch``: a decode stretch's allocations, then a step's
    updates (a jump whose last step finishes requests); the reply is a
    `StretchFinished`."""

    stretch: DecodeStretch
    updates: list[StepUpdate]


class FinishRun(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.finish_run``: a decode run's allocations, then a step's updates (a
    jump whose last step finishes requests); the reply is a `RunFinished`."""

    run: DecodeRun
    updates: list[StepUpdate]


class FinishChain(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.finish_chain``: decode steps whose finishing requests are freed as
    they finish (a jump that goes on past them); the reply is a `ChainAllocations`."""

    chain: DecodeChain


class GetManagerStats(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.stats`` plus the pool's occupancy."""


class CheckManager(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``KvManager.check_invariants`` (the pool's too); a breach crashes the actor."""


ManagerRequest: TypeAlias = (
    AllocateSlots
    | AllocateSteps
    | AllocateStretch
    | AllocateRun
    | MarkComputed
    | AppendTokens
    | AddRequest
    | ScheduleStep
    | ScheduleAfterChain
    | FreeRequest
    | PreemptRequest
    | GetPrefillCost
    | TakeEvents
    | TakeBatch
    | FinishStep
    | FinishStretch
    | FinishRun
    | FinishChain
    | GetManagerStats
    | CheckManager
)
"""Every request the manager extension handles."""


class AllocationReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `AllocateSlots`: None when it did not fit (and would not wait)."""

    allocation: Allocation | None


class StepsReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `AllocateSteps`: one `StepAllocations` per step tried, in order."""

    steps: list[StepAllocations]


class PrefillCostReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `GetPrefillCost` and to `AddRequest`."""

    cost: PrefillCost


class EventsReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `TakeEvents`: the drained events, oldest first."""

    events: list[KVEvent]


class BatchReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `TakeBatch`: None when no event was queued."""

    batch: KVEventBatch | None


class StretchFinished(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `FinishStretch`: the stretch's allocations, then the updates'
    outcome."""

    allocations: StretchAllocations
    outcome: StepOutcome


class RunFinished(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `FinishRun`: the run's allocations, then the updates' outcome."""

    allocations: RunAllocations
    outcome: StepOutcome


class ManagerStatsReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `GetManagerStats`: the manager's counters and the pool's occupancy."""

    stats: ManagerStats
    usage: PoolUsage


ManagerReply: TypeAlias = (
    AllocationReply
    | PrefillCostReply
    | EventsReply
    | BatchReply
    | StepOutcome
    | StepsReply
    | StepSchedule
    | StretchAllocations
    | StretchFinished
    | RunAllocations
    | RunFinished
    | ChainAllocations
    | ManagerStatsReply
    | DoneReply
    | ErrorReply
)
"""Every reply the manager extension sends (`DoneReply` for calls without a result)."""

ManagerMessage: TypeAlias = ManagerRequest | ManagerReply
"""Any message of the manager protocol."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ManagerMessage)


def encode(message: ManagerMessage) -> bytes:
    """Serialize ``message`` to msgpack (its tag names its kind)."""
    return _encoder.encode(message)


def decode(data: bytes) -> ManagerMessage:
    """Parse msgpack produced by `encode`; raises ``msgspec.ValidationError`` if malformed."""
    return _decoder.decode(data)


__all__ = [
    "AddRequest",
    "AllocateRun",
    "AllocateSlots",
    "AllocateSteps",
    "AllocateStretch",
    "AllocationReply",
    "AppendTokens",
    "BatchReply",
    "CheckManager",
    "EventsReply",
    "FinishChain",
    "FinishRun",
    "FinishStep",
    "FinishStretch",
    "FreeRequest",
    "GetManagerStats",
    "GetPrefillCost",
    "ManagerMessage",
    "ManagerReply",
    "ManagerRequest",
    "ManagerStatsReply",
    "MarkComputed",
    "PreemptRequest",
    "PrefillCostReply",
    "RunFinished",
    "ScheduleAfterChain",
    "ScheduleStep",
    "StepsReply",
    "StretchFinished",
    "TakeBatch",
    "TakeEvents",
    "decode",
    "encode",
]
