"""Several engines in one process, fed a workload in simulated time.

A discrete-event loop: the busy engine with the earliest clock steps next (ties by rank),
and a request is dispatched once every busy engine's clock has reached its arrival, so
what a dispatcher sees at an arrival is the cluster at that simulated instant. An idle
engine's clock jumps to the next request it is given. With ``speedup_ratio > 0`` the loop
sleeps so that simulated time runs ``speedup_ratio`` times faster than the wall clock;
with 0 (the default) it never sleeps.

Fast-forward (``fast_forward``, the default): before stepping an engine the loop asks it
to jump over the steps that only decode (`MockEngine.fast_forward`) and that start before
the next arrival; such steps touch nothing another engine or the dispatcher sees (the
last may admit, and finish, a request, which the loop counts as after a step), so the
run is identical to stepping one step at a time, only faster. A paced run does not let
a jump cross block boundaries, so that no event batch is published before its time.

Dispatch: ``least-loaded`` (default) gives a request to the engine with the fewest
outstanding (waiting + running) requests, lowest rank on ties; ``round-robin`` cycles
through the ranks. Both are deterministic.

The busy engines wait in a heap keyed by (clock, rank), so choosing the next to step
costs O(log busy) whatever the number of workers, and least-loaded dispatch reads a heap
of loads the same way; requests are pulled from their iterable one at a time, so a
streamed trace is never held whole.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from itertools import pairwise
from typing import Literal

import anyio

from kvpool.engine.engine import MockEngine
from kvpool.errors import InvalidArgumentError
from kvpool.workloads import RequestSpec

Dispatch = Literal["least-loaded", "round-robin"]
ProgressCallback = Callable[[int, int, float], None]
"""Called as ``(requests finished or rejected, requests in the workload, simulated s)``;
the workload's count is 0 when ``requests`` has no length (a plain iterator)."""


class Simulation:
    """Runs ``requests`` (ordered by arrival) through ``engines`` until all are done.

    ``requests`` is any iterable, read once, in order; a sequence out of arrival order is
    refused here, an iterator when the request out of order comes up (`run` raises
    `InvalidArgumentError` then, with the earlier requests already simulated).
    """

    def __init__(
        self,
        engines: Sequence[MockEngine],
        requests: Iterable[RequestSpec],
        *,
        dispatch: Dispatch = "least-loaded",
        speedup_ratio: float = 0.0,
        on_progress: ProgressCallback | None = None,
        fast_forward: bool = True,
    ) -> None:
        if not engines:
            raise InvalidArgumentError("a simulation needs at least one engine")
        if dispatch not in ("least-loaded", "round-robin"):
            raise InvalidArgumentError(f"unknown dispatch policy {dispatch!r}")
        if not speedup_ratio >= 0:
            raise InvalidArgumentError(f"speedup_ratio must be >= 0, got {speedup_ratio!r}")
        if isinstance(requests, Sequence) and any(
            b.arrival_s < a.arrival_s for a, b in pairwise(requests)
        ):
            raise InvalidArgumentError("requests must be ordered by arrival time")
        self.engines = list(engines)
        self.requests = requests
        self.dispatch = dispatch
        self.speedup_ratio = speedup_ratio
        self.on_progress = on_progress
        self.fast_forward = fast_forward
        self.wall_s = 0.0
        self._next_rank = 0

    async def run(self) -> float:
        """Dispatch and step until every request has finished or been rejected.

        Returns the wall-clock seconds it took (also kept in ``wall_s``). Cancellation
        stops it between two engine calls; the engines keep their partial state.
        """
        engines = self.engines
        requests = self.requests
        total = len(requests) if isinstance(requests, Sized) else 0
        report = self.on_progress
        speedup = self.speedup_ratio
        fast_forward = self.fast_forward
        settled = sum(engine.stats.completed + engine.stats.rejected for engine in engines)
        # (clock, rank, index) of each busy engine, earliest first. A busy engine's clock
        # moves only when it steps (advance_to leaves it alone), and it is off the heap
        # while it steps, so every key on the heap is its engine's current clock.
        busy = [(e.clock, e.rank, i) for i, e in enumerate(engines) if e.has_work]
        heapq.heapify(busy)
        queued = [False] * len(engines)  # on the heap (busy)
        for _, _, index in busy:
            queued[index] = True
        loads = _LoadHeap(engines) if self.dispatch == "least-loaded" else None
        arrivals = iter(requests)
        spec = next(arrivals, None)
        last_arrival = 0.0 if spec is None else spec.arrival_s
        start = time.perf_counter()
        while True:
            if spec is not None and (not busy or spec.arrival_s <= busy[0][0]):
                if spec.arrival_s < last_arrival:
                    raise InvalidArgumentError(
                        f"requests must be ordered by arrival time: {spec.request_id} "
                        f"arrives at {spec.arrival_s}s, after one at {last_arrival}s"
                    )
                last_arrival = spec.arrival_s
                if speedup > 0:
                    await _sleep_until(start + spec.arrival_s / speedup)
                index = self._round_robin() if loads is None else loads.lightest()
                engine = engines[index]
                engine.advance_to(spec.arrival_s)
                if not await engine.submit(spec, spec.arrival_s):
                    settled += 1
                    if report is not None:
                        report(settled, total, spec.arrival_s)
                    spec = next(arrivals, None)
                    continue
                if loads is not None:
                    loads.changed(index)
                if not queued[index]:
                    heapq.heappush(busy, (engine.clock, engine.rank, index))
                    queued[index] = True
                spec = next(arrivals, None)
                continue
            if not busy:
                break
            _, _, index = heapq.heappop(busy)
            engine = engines[index]
            completed = engine.stats.completed
            # A step is taken only if it starts before the next arrival (ties: the
            # arrival first), so a jump may cover only such steps. (A jump's last step
            # may admit a request, which may finish in it.)
            if not (
                fast_forward
                and await engine.fast_forward(
                    math.inf if spec is None else spec.arrival_s, cross_boundaries=not speedup
                )
            ):
                await engine.step()
            if engine.stats.completed != completed:
                settled += engine.stats.completed - completed
                if loads is not None:
                    loads.changed(index)
            if engine.has_work:
                heapq.heappush(busy, (engine.clock, engine.rank, index))
            else:
                queued[index] = False
            if speedup > 0:
                await _sleep_until(start + engine.clock / speedup)
            if report is not None:
                report(settled, total, engine.clock)
        self.wall_s = time.perf_counter() - start
        return self.wall_s

    def _round_robin(self) -> int:
        index = self._next_rank
        self._next_rank = (index + 1) % len(self.engines)
        return index


class _LoadHeap:
    """The engines by (outstanding requests, index): least-loaded dispatch in O(log n).

    Lazy: a changed load pushes a fresh entry and the stale ones are dropped when they
    surface, so every engine always has an entry holding its current load (`changed`
    must be called after every change: an accepted submit, a step that finished one).
    Rebuilt when stale entries outnumber the engines, so it stays O(engines) in size.
    """

    def __init__(self, engines: Sequence[MockEngine]) -> None:
        self._engines = engines
        self._heap: list[tuple[int, int]] = []
        self._rebuild()

    def lightest(self) -> int:
        """The index of the engine with the fewest outstanding requests (lowest on ties)."""
        heap = self._heap
        engines = self._engines
        while True:
            load, index = heap[0]
            if engines[index].num_outstanding == load:
                return index
            heapq.heappop(heap)

    def changed(self, index: int) -> None:
        """Engine ``index``'s load changed."""
        heapq.heappush(self._heap, (self._engines[index].num_outstanding, index))
        if len(self._heap) > 2 * len(self._engines) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(engine.num_outstanding, i) for i, engine in enumerate(self._engines)]
        heapq.heapify(self._heap)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await anyio.sleep(delay)
