"""`Outbox`: a request's outputs from the engine driver to its reader, on asyncio, uvloop
and trio: order, end, a reader that leaves, and cancellation while waiting."""

from __future__ import annotations

import anyio
import pytest

from kvpool.actors.slots import current_slots
from kvpool.serve.outbox import Outbox

pytestmark = pytest.mark.anyio
GUARD_S = 10


async def test_outputs_arrive_in_order_then_the_end() -> None:
    outbox = Outbox[int](current_slots())
    with pytest.raises(anyio.WouldBlock):
        outbox.receive_nowait()
    assert outbox.put(1)
    assert outbox.put(2)
    assert await outbox.receive() == 1
    assert outbox.receive_nowait() == 2
    outbox.put(3)
    outbox.end()
    with pytest.raises(anyio.ClosedResourceError):
        outbox.put(4)
    assert [item async for item in outbox] == [3]
    with pytest.raises(anyio.EndOfStream):
        await outbox.receive()


async def test_a_waiting_reader_is_woken_by_each_put_and_by_the_end() -> None:
    outbox = Outbox[int](current_slots())
    got: list[int] = []

    async def read() -> None:
        got.extend([item async for item in outbox])

    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read)
            for item in range(5):
                await anyio.sleep(0.001)  # the reader is parked on an empty outbox
                outbox.put(item)
            await anyio.sleep(0.001)
            outbox.end()
    assert got == [0, 1, 2, 3, 4]


async def test_a_closed_reader_refuses_puts_and_drops_what_was_queued() -> None:
    outbox = Outbox[int](current_slots())
    outbox.put(1)
    outbox.close()
    assert not outbox.listening
    assert outbox.put(2) is False
    with pytest.raises(anyio.ClosedResourceError):
        outbox.receive_nowait()
    outbox.end()  # the driver may still end it
    with pytest.raises(anyio.ClosedResourceError):
        await outbox.receive()


async def test_a_reader_cancelled_while_waiting_loses_nothing_and_breaks_no_put() -> None:
    outbox = Outbox[int](current_slots())
    with anyio.fail_after(GUARD_S):
        with anyio.move_on_after(0.01) as scope:
            await outbox.receive()  # nothing comes: cancelled while parked
        assert scope.cancelled_caught
        assert outbox.put(7)  # the abandoned wait is not woken, and nothing raises
        assert await outbox.receive() == 7


async def test_only_a_read_that_waits_is_a_cancel_point() -> None:
    outbox = Outbox[int](current_slots())
    outbox.put(1)
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await outbox.receive() == 1  # queued: returned, no checkpoint
        await outbox.receive()  # empty: waits, so the cancellation is raised here
        pytest.fail("a waiting read in a cancelled scope returned")
    assert scope.cancelled_caught
    outbox.put(2)
    assert outbox.receive_nowait() == 2
