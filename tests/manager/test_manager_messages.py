"""Every manager protocol message round-trips through msgpack unchanged."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from kvpool.events import BlockRemoved, BlockStored, KVEventBatch
from kvpool.manager import (
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
    ManagerMessage,
    ManagerReply,
    ManagerRequest,
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
    decode,
    encode,
)
from kvpool.messages import DoneReply, ErrorReply
from kvpool.pool import BlockId

MESSAGES: list[ManagerMessage] = [
    AddRequest("r1", [1, 2, 2**32 - 1]),
    AppendTokens("r1", [7]),
    ScheduleStep([], [QueuedRequest("r1", [1, 2, 2**32 - 1])], AdmissionGate(512, 30)),
    ScheduleStep(
        [SlotRequest("r2", 17, [5])],
        [QueuedRequest("r1"), QueuedRequest("r3", [4])],
        AdmissionGate(8, -2, 4, 1, 2, chunked=False, full_sequence=False),
    ),
    GetPrefillCost("r1"),
    AllocateSlots("r1", 17),
    AllocateSlots("r1", 17, wait=True),
    AllocateSlots("r1", 17, cache=True),
    AllocateSteps([[SlotRequest("r1", 17, [5, 6])], [], [SlotRequest("r1", 18)]]),
    AllocateSteps([[SlotRequest("r1", 17)]], "r2", PrefillCost(2, 1, 3)),
    FinishStep([StepUpdate("r1", [7], 18, False), StepUpdate("r2", [], -1, True)]),
    FinishStep([], "r3"),
    AllocateStretch(
        DecodeStretch(["r1", "r2"], [[7, 8], []], [0, 1, 0], [33, 17, 34], [1, 0, 1], [2, 3])
    ),
    AllocateStretch(DecodeStretch(["r1"], [[]], [0], [33], [0], [1]), "r2", PrefillCost(1, 0, 2)),
    FinishStretch(
        DecodeStretch(["r1"], [[7]], [0], [33], [1], [1]), [StepUpdate("r2", [], -1, True)]
    ),
    AllocateRun(DecodeRun(["r1", "r2"], [[7, 8], []], [33, 17], [0, -1], [15, 3], 40)),
    AllocateRun(DecodeRun(["r1"], [[]], [33], [0], [-1], 1), "r2", PrefillCost(1, 0, 2)),
    FinishRun(DecodeRun(["r1"], [[7]], [33], [0], [-1], 1), [StepUpdate("r2", [], -1, True)]),
    FinishChain(
        DecodeChain(
            DecodeRun(["r1", "r2"], [[7, 8], []], [33, 17], [0, -1], [15, 3], 40),
            [3, 20],
            [["r2", "r3"], ["r1"]],
        )
    ),
    FinishChain(DecodeChain(DecodeRun(["r1"], [[]], [33], [0], [-1], 1), [], [])),
    ScheduleAfterChain(
        DecodeChain(
            DecodeRun(["r1", "r2"], [[7], []], [33, 17], [0, -1], [-1, 3], 5), [2], [["r2"]]
        ),
        [SlotRequest("r1", 34)],
        [QueuedRequest("r3", [4, 5])],
        AdmissionGate(512, 30),
    ),
    MarkComputed("r1", 16),
    FreeRequest("r1"),
    PreemptRequest("r1"),
    TakeEvents(),
    TakeBatch(),
    TakeBatch(1.5, 0),
    GetManagerStats(),
    CheckManager(),
    AllocationReply(None),
    AllocationReply(Allocation([BlockId(2**40 + 3), BlockId(5)], 1, [2**64 - 1])),
    PrefillCostReply(PrefillCost(3, 1, 2)),
    EventsReply([]),
    EventsReply(
        [
            BlockRemoved(block_hashes=[1, 2]),
            BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1] * 4, block_size=4),
        ]
    ),
    ManagerStatsReply(ManagerStats(2, 100, 48, 3, 1), PoolUsage(10, 4, 64)),
    BatchReply(None),
    BatchReply(KVEventBatch(1.5, [BlockRemoved(block_hashes=[1])], 0)),
    StepsReply(
        [
            StepAllocations([Allocation([BlockId(5)], 0, [])], [], ManagerStats(2, 9, 4, 0, 0)),
            StepAllocations(
                [],
                [BlockRemoved(block_hashes=[3])],
                ManagerStats(2, 9, 4, 1, 0),
                PrefillCost(1, 0, 2),
            ),
        ]
    ),
    StretchAllocations(
        [Allocation([BlockId(7)], 0, [4])],
        [1, 2],
        [(1, [BlockRemoved(block_hashes=[4])])],
        ManagerStats(2, 9, 4, 1, 0, 2),
        PrefillCost(0, 0, 3),
    ),
    StretchFinished(
        StretchAllocations([Allocation([], 0, [])], [0], [], ManagerStats(2, 9, 4, 1, 0, 2)),
        StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(2, 9, 4, 1, 0, 2)),
    ),
    RunAllocations(
        [Allocation([7, 2], 0, []), Allocation([], 0, [])],
        5,
        [4, 2],
        [1, 2],
        [(1, [BlockRemoved(block_hashes=[4, 3])])],
        ManagerStats(2, 9, 4, 1, 0, 2),
        PrefillCost(0, 0, 3),
    ),
    RunFinished(
        RunAllocations([Allocation([], 0, [])], 1, [], [0], [], ManagerStats(2, 9, 4, 1, 0, 2)),
        StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(2, 9, 4, 1, 0, 2)),
    ),
    ChainAllocations(
        RunAllocations(
            [Allocation([7, 2], 0, []), Allocation([], 0, [])],
            5,
            [4, 2],
            [1, 2],
            [(1, [BlockRemoved(block_hashes=[4, 3])])],
            ManagerStats(2, 9, 4, 1, 0, 2),
        ),
        [
            StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(2, 9, 4, 1, 0, 2)),
            StepOutcome(
                [BlockRemoved(block_hashes=[5])], PoolUsage(2, 2, 8), ManagerStats(1, 9, 4, 2, 0, 3)
            ),
        ],
        [1, 2],
    ),
    ChainAllocations(
        RunAllocations([], 0, [], [], [], ManagerStats(0, 0, 0, 0, 0)),
        [],
        [],
    ),
    StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(1, 0, 0, 0, 0)),
    StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(1, 0, 0, 0, 0), PrefillCost(1, 1, 0)),
    StepSchedule(
        StepAllocations(
            [Allocation([BlockId(5)], 2, [9])],
            [BlockRemoved(block_hashes=[9])],
            ManagerStats(2, 9, 4, 1, 0, 1),
            PrefillCost(0, 0, 1),
        ),
        [PrefillCost(2, 1, 3)],
    ),
    StepSchedule(
        StepAllocations([], [], ManagerStats(1, 9, 4, 1, 0, 1)),
        [],
        ChainAllocations(
            RunAllocations(
                [Allocation([7], 0, [])], 1, [], [1], [], ManagerStats(1, 9, 4, 1, 0, 2)
            ),
            [StepOutcome([], PoolUsage(3, 1, 8), ManagerStats(1, 9, 4, 1, 0, 2))],
            [1],
        ),
    ),
    StepSchedule(
        StepAllocations([], [], ManagerStats(1, 9, 4, 1, 0, 1)),
        [],
        RunAllocations([], 0, [], [], [], ManagerStats(0, 0, 0, 0, 0)),
    ),
    DoneReply(),
    ErrorReply("UnknownRequestError", "request 'x' is not registered"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: ManagerMessage) -> None:
    assert decode(encode(message)) == message


def test_every_request_and_reply_kind_is_covered() -> None:
    kinds = {type(m) for m in MESSAGES}
    assert kinds == set(get_args(ManagerRequest)) | set(get_args(ManagerReply))


def test_a_malformed_message_is_a_validation_error() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "AllocateSlots", "request_id": 3}))


def test_tags_do_not_clash_with_the_pool_protocol() -> None:
    import kvpool.messages as pool_messages

    pool_kinds = {
        name for name in pool_messages.__all__ if isinstance(getattr(pool_messages, name), type)
    }
    manager_kinds = {type(m).__name__ for m in MESSAGES} - {"DoneReply", "ErrorReply"}
    assert not pool_kinds & manager_kinds
