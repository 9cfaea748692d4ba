"""A `kvpool.routing` router connected to a simulation's engines.

`RoutedDispatch` is what `kvpool.engine.simulation.Simulation` calls when ``dispatch`` is
a router: ``choose`` with each engine's `WorkerLoad` as of now, ``settled`` for each
finished or rejected request; each engine's published event batches reach the router
through a tap on its sink (`_Tap`), stamped with the simulated end of their step. All of
it goes through `kvpool.routing.Delivery`, so the router sees nothing before simulated
time reaches it (event batches ``event_delay_s`` later still).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.engine.engine import MockEngine
from kvpool.errors import InvalidArgumentError
from kvpool.events import EventSink, KVEventBatch
from kvpool.routing import Delivery, DispatchPolicy, WorkerLoad, uses_kv_events
from kvpool.workloads import RequestSpec


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
    """Routes a simulation's requests with ``policy`` (see the module docstring)."""

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
        """The router's worker for ``spec``, dispatched at ``now``."""
        loads = [
            WorkerLoad(
                index=index,
                num_running=len(engine.running),
                num_waiting=len(engine.waiting),
                active_blocks=max(0, engine.num_active_blocks),
                capacity=engine.config.num_gpu_blocks,
            )
            for index, engine in enumerate(self._engines)
        ]
        index = self.delivery.choose(spec, loads, now)
        if type(index) is not int or not 0 <= index < len(loads):
            raise InvalidArgumentError(f"the router chose worker {index!r} of {len(loads)}")
        return index

    def settled(self, index: int, request_id: str, now: float) -> None:
        """Request ``request_id`` finished (or was rejected) on engine ``index`` at ``now``."""
        self.delivery.finished(index, request_id, now)

    def overlap_seen(self, request_id: str) -> int | None:
        """The overlap the router saw for ``request_id``'s choice, if it reports one."""
        return self.delivery.overlap_seen(request_id)
