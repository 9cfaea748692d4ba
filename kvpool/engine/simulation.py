"""Several engines in one process, fed a workload in simulated time.

A discrete-event loop: the busy engine with the earliest clock steps next (ties by rank),
and a request is dispatched once every busy engine's clock has reached its arrival, so
what a dispatcher sees at an arrival is the cluster at that simulated instant. An idle
engine's clock jumps to the next request it is given. With ``speedup_ratio > 0`` the loop
sleeps so that simulated time runs ``speedup_ratio`` times faster than the wall clock;
with 0 (the default) it never sleeps.

Dispatch: ``least-loaded`` (default) gives a request to the engine with the fewest
outstanding (waiting + running) requests, lowest rank on ties; ``round-robin`` cycles
through the ranks. Both are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Literal

import anyio

from kvpool.engine.engine import MockEngine
from kvpool.errors import InvalidArgumentError
from kvpool.workloads import RequestSpec

Dispatch = Literal["least-loaded", "round-robin"]
ProgressCallback = Callable[[int, int, float], None]
"""Called as ``(requests finished or rejected, requests in the workload, simulated s)``."""


class Simulation:
    """Runs ``requests`` (ordered by arrival) through ``engines`` until all are done."""

    def __init__(
        self,
        engines: Sequence[MockEngine],
        requests: Sequence[RequestSpec],
        *,
        dispatch: Dispatch = "least-loaded",
        speedup_ratio: float = 0.0,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if not engines:
            raise InvalidArgumentError("a simulation needs at least one engine")
        if dispatch not in ("least-loaded", "round-robin"):
            raise InvalidArgumentError(f"unknown dispatch policy {dispatch!r}")
        if not speedup_ratio >= 0:
            raise InvalidArgumentError(f"speedup_ratio must be >= 0, got {speedup_ratio!r}")
        if any(b.arrival_s < a.arrival_s for a, b in pairwise(requests)):
            raise InvalidArgumentError("requests must be ordered by arrival time")
        self.engines = list(engines)
        self.requests = requests
        self.dispatch = dispatch
        self.speedup_ratio = speedup_ratio
        self.on_progress = on_progress
        self.wall_s = 0.0
        self._next_rank = 0

    async def run(self) -> float:
        """Dispatch and step until every request has finished or been rejected.

        Returns the wall-clock seconds it took (also kept in ``wall_s``). Cancellation
        stops it between two engine calls; the engines keep their partial state.
        """
        engines = self.engines
        requests = self.requests
        total = len(requests)
        report = self.on_progress
        speedup = self.speedup_ratio
        start = time.perf_counter()
        index = 0
        while True:
            busy = [engine for engine in engines if engine.has_work]
            earliest = min(busy, key=_clock_then_rank) if busy else None
            if index < total and (earliest is None or requests[index].arrival_s <= earliest.clock):
                spec = requests[index]
                index += 1
                if speedup > 0:
                    await _sleep_until(start + spec.arrival_s / speedup)
                engine = self._choose()
                engine.advance_to(spec.arrival_s)
                if not await engine.submit(spec, spec.arrival_s) and report is not None:
                    report(self._settled(), total, spec.arrival_s)
                continue
            if earliest is None:
                break
            await earliest.step()
            if speedup > 0:
                await _sleep_until(start + earliest.clock / speedup)
            if report is not None:
                report(self._settled(), total, earliest.clock)
        self.wall_s = time.perf_counter() - start
        return self.wall_s

    def _choose(self) -> MockEngine:
        if self.dispatch == "round-robin":
            engine = self.engines[self._next_rank]
            self._next_rank = (self._next_rank + 1) % len(self.engines)
            return engine
        return min(self.engines, key=lambda engine: engine.num_outstanding)

    def _settled(self) -> int:
        return sum(engine.stats.completed + engine.stats.rejected for engine in self.engines)


def _clock_then_rank(engine: MockEngine) -> tuple[float, int]:
    return engine.clock, engine.rank


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await anyio.sleep(delay)
