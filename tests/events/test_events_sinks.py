"""In-process sinks: EventCollector, and EventStream delivery on asyncio, uvloop and trio."""

from __future__ import annotations

import math

import anyio
import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventCollector,
    EventSink,
    EventStream,
    KVEventBatch,
    ZmqEventPublisher,
)


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockRemoved(block_hashes=[n])])


def test_every_sink_satisfies_the_protocol() -> None:
    assert isinstance(EventCollector(), EventSink)
    assert isinstance(EventStream(), EventSink)
    assert issubclass(ZmqEventPublisher, EventSink)


def test_collector_keeps_batches_in_order_and_flattens_events() -> None:
    sink = EventCollector()
    second = KVEventBatch(ts=2.0, events=[AllBlocksCleared(), BlockRemoved(block_hashes=[3])])
    sink.publish(batch(1))
    sink.publish(second)
    assert len(sink) == 2
    assert sink.events() == [
        BlockRemoved(block_hashes=[1]),
        AllBlocksCleared(),
        BlockRemoved(block_hashes=[3]),
    ]
    assert sink.take() == [batch(1), second]
    assert len(sink) == 0
    assert sink.events() == []


@pytest.mark.anyio
async def test_every_subscriber_gets_every_later_batch_in_order() -> None:
    stream = EventStream()
    stream.publish(batch(0))  # before anyone subscribed: goes nowhere
    first = stream.subscribe()
    stream.publish(batch(1))
    second = stream.subscribe()
    for n in (2, 3):
        stream.publish(batch(n))
    stream.close()
    with anyio.fail_after(5):
        async with first, second:
            assert [b async for b in first] == [batch(1), batch(2), batch(3)]
            assert [b async for b in second] == [batch(2), batch(3)]


@pytest.mark.anyio
async def test_a_waiting_subscriber_is_woken_by_each_publish() -> None:
    stream = EventStream()
    received: list[KVEventBatch] = []
    receiver = stream.subscribe(max_buffer_size=1)

    async def consume() -> None:
        async with receiver:
            received.extend([item async for item in receiver])

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            for n in range(20):
                while not receiver.statistics().tasks_waiting_receive:
                    await anyio.sleep(0)  # until the consumer waits in receive
                stream.publish(batch(n))
            stream.close()
    assert received == [batch(n) for n in range(20)]


@pytest.mark.anyio
async def test_a_full_bounded_subscriber_makes_publish_raise_and_nobody_gets_it() -> None:
    stream = EventStream()
    slow = stream.subscribe(max_buffer_size=2)
    fast = stream.subscribe()
    stream.publish(batch(0))
    stream.publish(batch(1))
    with pytest.raises(anyio.WouldBlock):
        stream.publish(batch(2))
    assert fast.statistics().current_buffer_used == 2  # the fast one did not get batch 2
    assert slow.receive_nowait() == batch(0)
    stream.publish(batch(2))  # room again: the producer's retry succeeds for everyone
    stream.close()
    with anyio.fail_after(5):
        async with slow, fast:
            assert [b async for b in slow] == [batch(1), batch(2)]
            assert [b async for b in fast] == [batch(0), batch(1), batch(2)]


@pytest.mark.anyio
async def test_closed_subscribers_are_forgotten_without_error() -> None:
    stream = EventStream()
    gone = stream.subscribe(max_buffer_size=1)
    stays = stream.subscribe()
    assert stream.num_subscribers == 2
    await gone.aclose()
    assert stream.num_subscribers == 1
    stream.publish(batch(0))
    stream.publish(batch(1))  # the closed bounded one would be full: it must not count
    stream.close()
    with anyio.fail_after(5):
        async with stays:
            assert [b async for b in stays] == [batch(0), batch(1)]
    assert stream.num_subscribers == 0


@pytest.mark.anyio
async def test_closed_stream_refuses_publish_and_subscribe() -> None:
    with EventStream() as stream:
        receiver = stream.subscribe()
    assert stream.closed
    with pytest.raises(anyio.ClosedResourceError):
        stream.publish(batch(0))
    with pytest.raises(anyio.ClosedResourceError):
        stream.subscribe()
    stream.close()  # idempotent
    with pytest.raises(anyio.EndOfStream):
        await receiver.receive()
    receiver.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", -math.inf])
def test_bad_buffer_size_raises_and_adds_no_subscriber(bad: object) -> None:
    stream = EventStream()
    with pytest.raises(InvalidArgumentError):
        stream.subscribe(max_buffer_size=bad)  # type: ignore[arg-type]
    assert stream.num_subscribers == 0
