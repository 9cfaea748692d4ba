"""Where a request goes: the one dispatch point of both engine loops.

The policies: `LeastLoaded` (the worker with the fewest outstanding, waiting plus
running, requests; lowest index on ties), `RoundRobin` (the workers in turn), or any
`kvpool.routing.DispatchPolicy` (Dynamo's KV router, llm-d's scheduler, a user's
plug-in), whose contract `kvpool.routing.policy` states. `make_policy` turns a
``--dispatch`` name into one.

`bind` connects a policy to a fleet of `MockEngine`\\ s as a `Dispatcher`, what a loop
calls: ``choose`` at each arrival, ``changed`` after a worker's load changed (an accepted
submit, a step that finished a request), ``settled`` for each finished or rejected
request. The two plain policies get a dispatcher of their own that reads no
`WorkerLoad` (least-loaded from a heap of loads in O(log n), or always the one engine
there is; round-robin from a counter), with the same choices as the policy objects; a
router gets `RoutedDispatch`, which gives it each worker's `WorkerLoad` as of now and its
KV events through a tap on each engine's sink, stamped with the simulated end of their
step, all through `kvpool.routing.Delivery`, so the router sees nothing before simulated
time reaches it (event batches ``event_delay_s`` later still).

setup.py compiles this module with mypyc, with the loops that call it at every arrival.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal, Protocol

from kvpool.engine.engine import MockEngine
from kvpool.errors import InvalidArgumentError
from kvpool.events import EventSink, KVEvent, KVEventBatch
from kvpool.routing import Delivery, DispatchPolicy, WorkerLoad, uses_kv_events
from kvpool.workloads import RequestSpec

Dispatch = Literal["least-loaded", "round-robin"]
"""The plain policies' names."""


class LeastLoaded:
    """The worker with the fewest outstanding requests, lowest index on ties."""

    uses_kv_events = False

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        return min(loads, key=lambda load: (load.num_running + load.num_waiting, load.index)).index

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        pass

    def finished(self, worker: int, request_id: str, now: float) -> None:
        pass


class RoundRobin:
    """The workers in turn, from index 0."""

    uses_kv_events = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        index = self._next
        self._next = (index + 1) % len(loads)
        return index

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        pass

    def finished(self, worker: int, request_id: str, now: float) -> None:
        pass


def make_policy(policy: str | DispatchPolicy) -> DispatchPolicy:
    """The policy ``policy`` names (``least-loaded`` or ``round-robin``), or ``policy``
    itself when it is one; raises `InvalidArgumentError` for another name (a router's
    name is `kvpool.routing.make_router`'s business: it needs the fleet's settings)."""
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "round-robin":
        return RoundRobin()
    if isinstance(policy, str):
        raise InvalidArgumentError(f"unknown dispatch policy {policy!r}")
    return policy


class Dispatcher(Protocol):
    """A policy bound to a fleet of engines (see the module docstring)."""

    reads_usage: bool
    """Whether ``choose`` reads the engines' active blocks (`WorkerLoad`): the loop
    makes them exact first (`MockEngine.settle_usage`)."""

    def choose(self, spec: RequestSpec, now: float) -> int:
        """The index of the engine ``spec``, arriving at ``now``, goes to."""
        ...

    def changed(self, index: int) -> None:
        """Engine ``index``'s load changed."""
        ...

    def settled(self, index: int, request_id: str, now: float) -> None:
        """Request ``request_id`` finished (or was rejected) on engine ``index`` at ``now``."""
        ...


def bind(
    policy: DispatchPolicy, engines: Sequence[MockEngine], *, event_delay_s: float = 0.0
) -> Dispatcher:
    """The `Dispatcher` that runs ``policy`` over ``engines``."""
    if type(policy) is LeastLoaded:
        # the least loaded of one engine is that engine: no load to keep
        return _Cycle(1) if len(engines) == 1 else _LoadHeap(engines)
    if type(policy) is RoundRobin:
        return _Cycle(len(engines))
    return RoutedDispatch(policy, engines, event_delay_s=event_delay_s)


def worker_load(index: int, engine: MockEngine) -> WorkerLoad:
    """Engine ``index``'s `WorkerLoad` as of now."""
    return WorkerLoad(
        index=index,
        num_running=len(engine.running),
        num_waiting=len(engine.waiting),
        active_blocks=max(0, engine.num_active_blocks),
        capacity=engine.config.num_gpu_blocks,
    )


class _LoadHeap:
    """`LeastLoaded` in O(log n): the engines by (outstanding requests, index).

    Lazy: a changed load pushes a fresh entry and the stale ones are dropped when they
    surface, so every engine always has an entry holding its current load (`changed`
    must be called after every change: an accepted submit, a step that finished one).
    Rebuilt when stale entries outnumber the engines, so it stays O(engines) in size.
    Built at its first use, so the loads the engines had before the loop started count.
    """

    reads_usage = False

    def __init__(self, engines: Sequence[MockEngine]) -> None:
        self._engines = engines
        self._heap: list[tuple[int, int]] | None = None

    def choose(self, spec: RequestSpec, now: float) -> int:
        heap = self._heap if self._heap is not None else self._rebuild()
        engines = self._engines
        while True:
            load, index = heap[0]
            if engines[index].num_outstanding == load:
                return index
            heapq.heappop(heap)

    def changed(self, index: int) -> None:
        heap = self._heap
        if heap is None:
            self._rebuild()  # reads every current load, this one's too
            return
        heapq.heappush(heap, (self._engines[index].num_outstanding, index))
        if len(heap) > 2 * len(self._engines) + 64:
            self._rebuild()

    def settled(self, index: int, request_id: str, now: float) -> None:
        pass

    def _rebuild(self) -> list[tuple[int, int]]:
        heap = [(engine.num_outstanding, i) for i, engine in enumerate(self._engines)]
        heapq.heapify(heap)
        self._heap = heap
        return heap


class _Cycle:
    """`RoundRobin` over ``size`` engines."""

    reads_usage = False

    def __init__(self, size: int) -> None:
        self._size = size
        self._next = 0

    def choose(self, spec: RequestSpec, now: float) -> int:
        index = self._next
        self._next = (index + 1) % self._size
        return index

    def changed(self, index: int) -> None:
        pass

    def settled(self, index: int, request_id: str, now: float) -> None:
        pass


class _Tap:
    """An engine's event sink that also hands each batch to the router."""

    __slots__ = ("_delivery", "_engine", "_index", "_inner")

    def __init__(
        self, delivery: Delivery, index: int, engine: MockEngine, inner: EventSink | None
    ) -> None:
        self._delivery = delivery
        self._index = index
        self._engine = engine
        self._inner = inner

    def publish(self, batch: KVEventBatch) -> None:
        engine = self._engine
        now = (batch.ts - engine.epoch) / engine.ts_scale  # the step's simulated end
        self._delivery.observe(self._index, batch.events, now)
        if self._inner is not None:
            self._inner.publish(batch)


class RoutedDispatch:
    """Routes the engines' requests with a router ``policy`` (see the module docstring)."""

    reads_usage = True

    def __init__(
        self, policy: DispatchPolicy, engines: Sequence[MockEngine], *, event_delay_s: float
    ) -> None:
        self.delivery = Delivery(policy, event_delay_s=event_delay_s)
        self._engines = engines
        if uses_kv_events(policy):
            for index, engine in enumerate(engines):
                if not engine.config.enable_kv_cache_events:
                    raise InvalidArgumentError(
                        "this router reads KV events: the engines need enable_kv_cache_events"
                    )
                engine.sink = _Tap(self.delivery, index, engine, engine.sink)

    def choose(self, spec: RequestSpec, now: float) -> int:
        loads = [worker_load(index, engine) for index, engine in enumerate(self._engines)]
        index = self.delivery.choose(spec, loads, now)
        if type(index) is not int or not 0 <= index < len(loads):
            raise InvalidArgumentError(f"the router chose worker {index!r} of {len(loads)}")
        return index

    def changed(self, index: int) -> None:
        pass  # the router reads the loads afresh at each choice

    def settled(self, index: int, request_id: str, now: float) -> None:
        self.delivery.finished(index, request_id, now)

    def overlap_seen(self, request_id: str) -> int | None:
        """The overlap the router saw for ``request_id``'s choice, if it reports one."""
        return self.delivery.overlap_seen(request_id)


__all__ = [
    "Dispatch",
    "Dispatcher",
    "DispatchPolicy",
    "LeastLoaded",
    "RoundRobin",
    "RoutedDispatch",
    "WorkerLoad",
    "bind",
    "make_policy",
    "worker_load",
]
