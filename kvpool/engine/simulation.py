"""Several engines in one process, fed a workload in simulated time.

The discrete-event loop is `kvpool.engine.loop.EngineLoop`, serve's too (its docstring
states the stepping, dispatch and fast-forward rules): this class is its source
(`Arrivals`, by simulated time: open loop, closed loop, sessions) and its step hook
(settling finished requests with the arrivals and the dispatcher, progress). Lockstep
ranks (``lockstep``) step together and have a loop of their own here, submitting through
`EngineLoop.submit`. With ``speedup_ratio > 0`` the run sleeps so that simulated time
runs ``speedup_ratio`` times faster than the wall clock (`WallPacer`); with 0 (the
default) it never sleeps. A paced run does not let a jump cross block boundaries, so
that no event batch is published before its time.

Dispatch: ``least-loaded`` (default), ``round-robin`` or a `kvpool.routing.DispatchPolicy`
(Dynamo's KV router, llm-d's scheduler, a user's), run through `kvpool.engine.dispatch`.
Requests are pulled from their iterable one at a time, as the clock reaches them.
setup.py compiles this module with mypyc (the loop's source and hook run at every turn).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

from kvpool.engine.arrivals import Arrivals
from kvpool.engine.clock import WallPacer
from kvpool.engine.dispatch import Dispatch, RoutedDispatch, bind, make_policy
from kvpool.engine.engine import MockEngine, StepResult
from kvpool.engine.loop import EngineLoop
from kvpool.errors import InvalidArgumentError
from kvpool.routing import DispatchPolicy
from kvpool.workloads import RequestSpec
from kvpool.workloads.session import Session

ProgressCallback = Callable[[int, int, float], None]
"""Called as ``(requests finished or rejected, requests in the workload, simulated s)``;
the workload's count is 0 when ``requests`` has no length (a plain iterator)."""


class Simulation:
    """Runs ``requests`` (ordered by arrival) through ``engines`` until all are done.

    ``requests`` is any iterable of requests or `Session`\\ s, read once, in order; when
    each is sent is `Arrivals`' business (open loop at its timestamp over
    ``arrival_speedup_ratio``, or closed loop with ``concurrency`` in flight). A sequence
    out of arrival order is refused here (open loop), an iterator when the request out
    of order comes up (`run` raises `InvalidArgumentError` then, with the earlier
    requests already simulated).

    ``max_sim_time_s`` stops the simulated clock: nothing is sent at or after it, no
    step starts at or after it (a step that started before it ends, as a forward pass
    does), and the requests still waiting or running then are aborted, their blocks
    freed; ``unfinished`` and ``unstarted`` count what was cut.

    ``lockstep`` makes the engines data-parallel ranks of one model that step together
    (vLLM's MoE data parallelism, Dynamo's ``dp_size``): whenever a rank has work,
    every rank steps, each step lasts as long as the slowest rank's (`MockEngine`'s
    `schedule_step`, then `execute_step` with the longest `step_duration`), and an idle
    rank runs a dummy step of that length, so a request sent to it mid-step starts at
    the step's end. The ranks share one clock; steps are taken one at a time (no
    fast-forward). Without it (the default) each engine has a clock of its own.
    """

    def __init__(
        self,
        engines: Sequence[MockEngine],
        requests: Iterable[RequestSpec | Session],
        *,
        dispatch: Dispatch | DispatchPolicy = "least-loaded",
        router_event_delay_s: float = 0.0,
        speedup_ratio: float = 0.0,
        on_progress: ProgressCallback | None = None,
        fast_forward: bool = True,
        concurrency: int | None = None,
        arrival_speedup_ratio: float = 1.0,
        max_sim_time_s: float | None = None,
        lockstep: bool = False,
    ) -> None:
        if not engines:
            raise InvalidArgumentError("a simulation needs at least one engine")
        policy = make_policy(dispatch)
        if not speedup_ratio >= 0:
            raise InvalidArgumentError(f"speedup_ratio must be >= 0, got {speedup_ratio!r}")
        if max_sim_time_s is not None and not max_sim_time_s > 0:
            raise InvalidArgumentError(f"max_sim_time_s must be > 0, got {max_sim_time_s!r}")
        if (
            concurrency is None
            and isinstance(requests, Sequence)
            and any(b.arrival_s < a.arrival_s for a, b in pairwise(requests))
        ):
            raise InvalidArgumentError("requests must be ordered by arrival time")
        self.engines = list(engines)
        self.arrivals = Arrivals(
            requests, concurrency=concurrency, arrival_speedup_ratio=arrival_speedup_ratio
        )
        self.dispatch = dispatch
        self.dispatcher = bind(policy, self.engines, event_delay_s=router_event_delay_s)
        # the router, when ``dispatch`` is one (the runner reports on it)
        self.router = self.dispatcher if isinstance(self.dispatcher, RoutedDispatch) else None
        self.speedup_ratio = speedup_ratio
        self.on_progress = on_progress
        self.fast_forward = fast_forward
        self.max_sim_time_s = max_sim_time_s
        self.lockstep = lockstep
        self.wall_s = 0.0
        self.unfinished = 0
        self.unstarted = 0
        # each engine's records already passed to `arrivals.settled` (set by `run`)
        self._seen: list[int] = []
        self._settled = 0  # requests finished or rejected (for ``on_progress``)
        self._pacer = WallPacer(speedup_ratio)  # the current run's (`run` starts a new one)

    async def run(self) -> float:
        """Dispatch and step until every request has finished or been rejected (or the
        clock reached ``max_sim_time_s``).

        Returns the wall-clock seconds it took (also kept in ``wall_s``). Cancellation
        stops it between two engine calls; the engines keep their partial state.
        """
        pacer = self._pacer = WallPacer(self.speedup_ratio)  # simulated 0 is now
        if self.lockstep:
            await self._run_lockstep(pacer)
        else:
            await self._run_loop(pacer)
        if self.max_sim_time_s is not None:
            await self._cut()
        self.wall_s = time.perf_counter() - pacer.start_s
        return self.wall_s

    async def _run_loop(self, pacer: WallPacer) -> None:
        """`run` on the shared `EngineLoop`, the `Arrivals` its source."""
        engines = self.engines
        self._settled = sum(engine.stats.completed + engine.stats.rejected for engine in engines)
        self._seen = [len(engine.stats.requests) for engine in engines]
        paced = pacer.paced
        loop = EngineLoop(
            engines,
            self.dispatcher,
            fast_forward=self.fast_forward,
            cross_boundaries=not paced,
            cutoff=math.inf if self.max_sim_time_s is None else self.max_sim_time_s,
            pace=pacer.sleep_until if paced else None,
        )
        await loop.run(self, self._stepped)

    # ------------------------------------------------- the loop's source and hook

    @property
    def reactive(self) -> bool:
        """Whether a settled request may release another (`Arrivals.reactive`)."""
        return self.arrivals.reactive

    def next_arrival(self) -> float | None:
        """When the next request arrives, None if none is known now."""
        return self.arrivals.peek()

    async def take(self, loop: EngineLoop) -> None:
        """Send the next request (due: every busy engine reached its arrival)."""
        spec, when = self.arrivals.pop()
        if self._pacer.paced:
            await self._pacer.sleep_until(when)
        index, accepted = await loop.submit(spec, when)
        if not accepted:
            self._seen[index] += 1  # its rejection record
            self.arrivals.settled(spec.request_id, when)
            self._settled += 1
            if self.on_progress is not None:
                self.on_progress(self._settled, self.arrivals.total, when)

    async def _stepped(self, index: int, engine: MockEngine, result: StepResult | None) -> None:
        """After a step: settle what it finished, report progress."""
        if len(engine.stats.requests) != self._seen[index]:
            self._settled += self._settle(index, engine.clock)
        if self.on_progress is not None:
            self.on_progress(self._settled, self.arrivals.total, engine.clock)

    async def _run_lockstep(self, pacer: WallPacer) -> None:
        """`run` with the engines in lockstep (see the class docstring)."""
        engines = self.engines
        arrivals = self.arrivals
        total = arrivals.total
        report = self.on_progress
        speedup = self.speedup_ratio
        cutoff = math.inf if self.max_sim_time_s is None else self.max_sim_time_s
        settled = sum(engine.stats.completed + engine.stats.rejected for engine in engines)
        seen = self._seen = [len(engine.stats.requests) for engine in engines]
        submitter = EngineLoop(engines, self.dispatcher)  # its dispatch; the steps are here
        clock = max(engine.clock for engine in engines)
        for engine in engines:
            engine.advance_to(clock)
        while True:
            when = arrivals.peek()
            active = [engine for engine in engines if engine.has_work]
            if when is not None and when < cutoff and (not active or when <= clock):
                spec, when = arrivals.pop()
                if when > clock:  # every rank idle: the clock jumps to the arrival
                    clock = when
                    for engine in engines:
                        engine.advance_to(clock)
                if speedup > 0:
                    await pacer.sleep_until(when)
                index, accepted = await submitter.submit(spec, when)
                if not accepted:
                    seen[index] += 1  # its rejection record
                    arrivals.settled(spec.request_id, when)
                    settled += 1
                    if report is not None:
                        report(settled, total, when)
                continue
            if not active or clock >= cutoff:
                break
            plans = [await engine.schedule_step() for engine in active]
            duration = max(
                engine.step_duration(plan) for engine, plan in zip(active, plans, strict=True)
            )
            for engine, plan in zip(active, plans, strict=True):
                await engine.execute_step(plan, duration)
            clock = active[0].clock  # the same float on every rank: clock + duration
            for index, engine in enumerate(engines):
                engine.advance_to(clock)  # an idle rank ran a dummy step
                if len(engine.stats.requests) != seen[index]:
                    settled += self._settle(index, clock)
            if speedup > 0:
                await pacer.sleep_until(clock)
            if report is not None:
                report(settled, total, clock)

    def _settle(self, index: int, clock: float) -> int:
        """Tell the arrivals and the dispatcher of engine ``index``'s requests that
        finished since it was last asked (at their finish time; ``clock`` for a record
        without one); return how many."""
        dispatcher = self.dispatcher
        arrivals = self.arrivals
        dispatcher.changed(index)
        records = self.engines[index].stats.requests
        seen = self._seen[index]
        for record in records[seen:]:
            finished = clock if record.finish_s is None else record.finish_s
            arrivals.settled(record.request_id, finished)
            dispatcher.settled(index, record.request_id, finished)
        self._seen[index] = len(records)
        return len(records) - seen

    async def _cut(self) -> None:
        """The clock reached ``max_sim_time_s``: abort what is in flight, count what
        was never sent."""
        for engine in self.engines:
            for request in [*engine.running, *engine.waiting]:
                await engine.abort(request.request_id)
                self.unfinished += 1
        self.unstarted = self.arrivals.unsent()
