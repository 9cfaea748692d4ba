"""Every manager protocol message round-trips through msgpack unchanged."""

from __future__ import annotations

import msgspec
import pytest

from kvpool.events import BlockRemoved, BlockStored
from kvpool.manager import Allocation, ManagerStats, PrefillCost
from kvpool.manager.messages import (
    AddRequest,
    AllocateSlots,
    AllocationReply,
    AppendTokens,
    CheckManager,
    EventsReply,
    FreeRequest,
    GetManagerStats,
    GetPrefillCost,
    ManagerMessage,
    ManagerStatsReply,
    MarkComputed,
    PreemptRequest,
    PrefillCostReply,
    TakeEvents,
    decode,
    encode,
)
from kvpool.messages import DoneReply, ErrorReply
from kvpool.pool import BlockId

MESSAGES: list[ManagerMessage] = [
    AddRequest("r1", [1, 2, 2**32 - 1]),
    AppendTokens("r1", [7]),
    GetPrefillCost("r1"),
    AllocateSlots("r1", 17),
    AllocateSlots("r1", 17, wait=True),
    AllocateSlots("r1", 17, cache=True),
    MarkComputed("r1", 16),
    FreeRequest("r1"),
    PreemptRequest("r1"),
    TakeEvents(),
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
    ManagerStatsReply(ManagerStats(2, 100, 48, 3, 1), 10, 4, 64),
    DoneReply(),
    ErrorReply("UnknownRequestError", "request 'x' is not registered"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: ManagerMessage) -> None:
    assert decode(encode(message)) == message


def test_every_request_and_reply_kind_is_covered() -> None:
    kinds = {type(m) for m in MESSAGES}
    union = {
        AddRequest, AppendTokens, GetPrefillCost, AllocateSlots, MarkComputed, FreeRequest,
        PreemptRequest, TakeEvents, GetManagerStats, CheckManager, AllocationReply,
        PrefillCostReply, EventsReply, ManagerStatsReply, DoneReply, ErrorReply,
    }  # fmt: skip
    assert kinds == union


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
