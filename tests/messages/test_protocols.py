"""Each service declares every message kind once (`kvpool.actors.operation`): a request
Struct in its request union, a reply Struct in its reply union, a handler on its state,
and the codec round-trips both; nothing is declared that the unions do not name."""

from __future__ import annotations

from typing import Any, get_args

import msgspec
import pytest

import kvpool.messages as pool_messages
from kvpool.actors import Operation, PoolState, handler_table, pool_operations
from kvpool.errors import InvalidArgumentError
from kvpool.manager import KvManager
from kvpool.manager import messages as manager_messages
from kvpool.manager import operations as manager_operations
from kvpool.manager.operations import ManagerState
from kvpool.pool import BlockPool

SERVICES = {
    "pool": (
        pool_operations.OPERATIONS,
        pool_messages.Request,
        pool_messages.Reply,
        pool_messages.Message,
        lambda: PoolState(BlockPool(4)),
    ),
    "manager": (
        manager_operations.OPERATIONS,
        manager_messages.ManagerRequest,
        manager_messages.ManagerReply,
        manager_messages.ManagerMessage,
        lambda: ManagerState(KvManager(BlockPool(4), 4)),
    ),
}


@pytest.mark.parametrize("service", SERVICES)
def test_every_request_kind_is_declared_once_with_its_reply_and_handler(service: str) -> None:
    operations, requests, replies, message, make_state = SERVICES[service]
    declared = [operation.request for operation in operations]
    assert len(declared) == len(set(declared)), "a kind is declared twice"
    assert set(declared) == set(get_args(requests))
    reply_kinds = set(get_args(replies))
    state = make_state()
    table = state.table()
    assert set(table) == set(declared)
    for operation in operations:
        assert operation.reply in reply_kinds, operation.request.__name__
        handler = table[operation.request]
        assert handler.handle.__self__ is state  # type: ignore[attr-defined]
        assert handler.handle.__name__ == operation.handle.__name__  # type: ignore[attr-defined]
        assert (handler.undo is None) == (operation.undo is None)
        assert (handler.gives_back, handler.waits, handler.ordered) == (
            operation.gives_back,
            operation.waits,
            operation.ordered,
        )
    # every reply kind answers some request (the error reply answers any)
    answered = {operation.reply for operation in operations} | {pool_messages.ErrorReply}
    assert answered == reply_kinds
    # the codec's union is the requests and the replies
    assert set(get_args(message)) == set(get_args(requests)) | reply_kinds


@pytest.mark.parametrize("service", SERVICES)
def test_every_kind_is_a_tagged_struct(service: str) -> None:
    operations = SERVICES[service][0]
    for operation in operations:
        for kind in (operation.request, operation.reply):
            assert issubclass(kind, msgspec.Struct)
            assert kind.__struct_config__.tag == kind.__name__


def test_a_kind_declared_twice_is_refused() -> None:
    state = PoolState(BlockPool(4))
    twice: list[Operation[PoolState, Any, Any]] = [pool_operations.OPERATIONS[0]] * 2
    with pytest.raises(InvalidArgumentError, match="declared twice"):
        handler_table(twice, state)


def test_a_subclass_override_is_the_handler_that_runs() -> None:
    class Counting(PoolState):
        queries = 0

        def query_prefix(self, message: Any) -> Any:
            self.queries += 1
            return super().query_prefix(message)

    state = Counting(BlockPool(4))
    state.table()[pool_messages.QueryPrefix].handle(pool_messages.QueryPrefix(1))
    assert state.queries == 1


@pytest.mark.anyio
async def test_an_inline_waiting_allocation_that_does_not_fit_is_refused() -> None:
    from kvpool.engine import LocalKvClient, TimedKvClient
    from kvpool.errors import CannotWaitError

    kv = LocalKvClient.create(2, 4)
    await kv.add_request("a", [1] * 8)
    await kv.add_request("b", [2] * 8)
    assert await kv.allocate("a", 8, wait=True) is not None  # it fits: no wait needed
    with pytest.raises(CannotWaitError):
        await kv.allocate("b", 8, wait=True)
    assert kv.manager.num_blocks("b") == 0  # refused: nothing changed
    timed = TimedKvClient(kv)
    await timed.free("a")
    assert (timed.calls, timed.seconds > 0) == (1, True)
    assert (await kv.usage()).num_active == 0  # the timed client drives the same manager
