"""Where event batches go: the `EventSink` protocol and two in-process sinks.

A producer (the manager's owner, once per engine step) calls ``sink.publish(batch)``
synchronously; a sink never awaits, so it can be fed from inside an actor (the manager's). The
ZMQ sink lives in `kvpool.events.zmq_publisher` (pyzmq is optional).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvpool.errors import InvalidArgumentError
from kvpool.events.types import KVEvent, KVEventBatch


@runtime_checkable
class EventSink(Protocol):
    """Anything that accepts event batches, in order, without blocking."""

    def publish(self, batch: KVEventBatch) -> None:
        """Take ``batch``; batches published later are delivered after it."""
        ...


class EventCollector:
    """Keeps every published batch in memory, in order: for tests and offline analysis."""

    __slots__ = ("batches",)

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        """Append ``batch``; never raises."""
        self.batches.append(batch)

    def events(self) -> list[KVEvent]:
        """Return every collected event, batches flattened in publish order."""
        return [event for batch in self.batches for event in batch.events]

    def take(self) -> list[KVEventBatch]:
        """Return the collected batches and start over with none."""
        batches, self.batches = self.batches, []
        return batches

    def __len__(self) -> int:
        return len(self.batches)


class EventStream:
    """Fans batches out to in-process async subscribers over anyio memory streams.

    Each `subscribe` call gets its own receive stream carrying every batch published
    after it, in order. Back-pressure policy: nothing is ever dropped for a live
    subscriber. Buffers are unbounded by default (a slow subscriber costs memory, not
    events); a subscriber that asks for a bounded buffer makes `publish` raise
    ``anyio.WouldBlock`` while that buffer is full, and then no subscriber gets the
    batch, so the producer can retry it. A subscriber that closed its receive stream is
    forgotten; with no subscribers a batch goes nowhere, like a PUB socket's.

    Not thread-safe: publish and subscribe from the event loop's thread (any backend).
    """

    __slots__ = ("_closed", "_senders")

    def __init__(self) -> None:
        self._senders: list[MemoryObjectSendStream[KVEventBatch]] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closed

    @property
    def num_subscribers(self) -> int:
        """Subscribers whose receive stream is still open."""
        return sum(1 for s in self._senders if s.statistics().open_receive_streams)

    def subscribe(
        self, max_buffer_size: float = math.inf
    ) -> MemoryObjectReceiveStream[KVEventBatch]:
        """Return a new receive stream of every batch published from now on.

        Iterate it (``async for batch in stream``); it ends (``EndOfStream``) after the
        last batch once this EventStream is closed. Close it to unsubscribe.
        Raises ``anyio.ClosedResourceError`` if this EventStream is closed, and
        `InvalidArgumentError` unless ``max_buffer_size`` is ``math.inf`` or an int >= 1.
        """
        if max_buffer_size != math.inf and (
            type(max_buffer_size) is not int or max_buffer_size < 1
        ):
            raise InvalidArgumentError(
                f"max_buffer_size must be math.inf or an int >= 1, got {max_buffer_size!r}"
            )
        if self._closed:
            raise anyio.ClosedResourceError
        send, receive = anyio.create_memory_object_stream[KVEventBatch](max_buffer_size)
        self._senders.append(send)
        return receive

    def publish(self, batch: KVEventBatch) -> None:
        """Deliver ``batch`` to every live subscriber, or to none.

        Never blocks or awaits. Raises ``anyio.WouldBlock`` if a bounded subscriber's
        buffer is full (no subscriber got the batch), ``anyio.ClosedResourceError`` if
        this EventStream is closed.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        live = []
        for sender in self._senders:
            stats = sender.statistics()
            if not stats.open_receive_streams:
                sender.close()
                continue
            if stats.current_buffer_used >= stats.max_buffer_size:
                raise anyio.WouldBlock
            live.append(sender)
        self._senders = live
        for sender in live:  # every one has room: none of these raise
            sender.send_nowait(batch)

    def close(self) -> None:
        """End every subscription after its buffered batches; idempotent."""
        self._closed = True
        for sender in self._senders:
            sender.close()
        self._senders = []

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["EventCollector", "EventSink", "EventStream"]
