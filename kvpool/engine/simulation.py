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

Dispatch: ``least-loaded`` (default), ``round-robin`` or a `kvpool.routing.DispatchPolicy`
(Dynamo's KV router, llm-d's scheduler, a user's), run through `kvpool.engine.dispatch`.

The busy engines wait in a heap keyed by (clock, rank), so choosing the next to step
costs O(log busy) whatever the number of workers, and least-loaded dispatch reads a heap
of loads the same way; requests are pulled from their iterable one at a time, so a
streamed trace is never held whole.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

from kvpool.engine.arrivals import Arrivals
from kvpool.engine.clock import WallPacer
from kvpool.engine.dispatch import Dispatch, RoutedDispatch, bind, make_policy
from kvpool.engine.engine import MockEngine
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

    async def run(self) -> float:
        """Dispatch and step until every request has finished or been rejected (or the
        clock reached ``max_sim_time_s``).

        Returns the wall-clock seconds it took (also kept in ``wall_s``). Cancellation
        stops it between two engine calls; the engines keep their partial state.
        """
        if self.lockstep:
            pacer = WallPacer(self.speedup_ratio)
            await self._run_lockstep(pacer)
            if self.max_sim_time_s is not None:
                await self._cut()
            self.wall_s = time.perf_counter() - pacer.start_s
            return self.wall_s
        engines = self.engines
        arrivals = self.arrivals
        total = arrivals.total
        report = self.on_progress
        speedup = self.speedup_ratio
        fast_forward = self.fast_forward
        cutoff = math.inf if self.max_sim_time_s is None else self.max_sim_time_s
        settled = sum(engine.stats.completed + engine.stats.rejected for engine in engines)
        self._seen = [len(engine.stats.requests) for engine in engines]
        # (clock, rank, index) of each busy engine, earliest first. A busy engine's clock
        # moves only when it steps (advance_to leaves it alone), and it is off the heap
        # while it steps, so every key on the heap is its engine's current clock.
        busy = [(e.clock, e.rank, i) for i, e in enumerate(engines) if e.has_work]
        heapq.heapify(busy)
        queued = [False] * len(engines)  # on the heap (busy)
        for _, _, index in busy:
            queued[index] = True
        pacer = WallPacer(speedup)  # simulated 0 is now
        while True:
            when = arrivals.peek()
            if when is not None and when < cutoff and (not busy or when <= busy[0][0]):
                spec, when = arrivals.pop()
                if speedup > 0:
                    await pacer.sleep_until(when)
                given = await self._submit(spec, when)
                if given is None:
                    settled += 1
                    if report is not None:
                        report(settled, total, when)
                    continue
                if not queued[given]:
                    engine = engines[given]
                    heapq.heappush(busy, (engine.clock, engine.rank, given))
                    queued[given] = True
                continue
            if not busy or busy[0][0] >= cutoff:
                break
            _, _, index = heapq.heappop(busy)
            engine = engines[index]
            completed = engine.stats.completed
            # A step is taken only if it starts before the next arrival (ties: the
            # arrival first), so a jump may cover only such steps. (A jump's last step
            # may admit a request, which may finish in it.) While a request that
            # settles may release another (closed loop, a session's next turn), no
            # jump may pass another busy engine's clock either: its next step may end
            # with such a release.
            until = cutoff if when is None else min(when, cutoff)
            if busy and arrivals.reactive:
                until = min(until, busy[0][0])
            if not (
                fast_forward and await engine.fast_forward(until, cross_boundaries=not speedup)
            ):
                await engine.step()
            if engine.stats.completed != completed:
                settled += engine.stats.completed - completed
                self._settle(index, engine.clock)
            if engine.has_work:
                heapq.heappush(busy, (engine.clock, engine.rank, index))
            else:
                queued[index] = False
            if speedup > 0:
                await pacer.sleep_until(engine.clock)
            if report is not None:
                report(settled, total, engine.clock)
        if self.max_sim_time_s is not None:
            await self._cut()
        self.wall_s = time.perf_counter() - pacer.start_s
        return self.wall_s

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
                if await self._submit(spec, when) is None:
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

    async def _submit(self, spec: RequestSpec, when: float) -> int | None:
        """Send ``spec``, arriving at ``when``, to the engine the dispatcher chooses (an
        idle one's clock jumps to ``when``); return its index, or None if the engine
        rejected it (then settled: the arrivals and the dispatcher are told)."""
        dispatcher = self.dispatcher
        index = dispatcher.choose(spec, when)
        engine = self.engines[index]
        engine.advance_to(when)
        if not await engine.submit(spec, when):
            self._seen[index] += 1  # its rejection record
            self.arrivals.settled(spec.request_id, when)
            dispatcher.settled(index, spec.request_id, when)
            return None
        dispatcher.changed(index)
        return index

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
