"""The one engine loop of ``kvpool simulate`` and ``kvpool serve``: `EngineLoop`.

A discrete-event loop over N engines. The busy engines wait in a heap keyed by
(clock, rank); each turn the loop either lets its `Source` hand it what has arrived or
steps the busy engine with the earliest clock. What differs between the commands is
only where requests come from and what becomes of a step:

- the `Source`. ``kvpool simulate``'s reads `Arrivals` by simulated time (open loop,
  closed loop, sessions): its next arrival is due once every busy engine's clock has
  reached it, so what the dispatcher sees at an arrival is the cluster at that
  instant. ``kvpool serve``'s is a live intake, an anyio stream of the HTTP handlers'
  Submit/Abort/AbortAll messages, each stamped with the wall-clock time it was sent
  (simulated time through `WallPacer.now`): messages that wait are due at once (their
  arrival is ``-inf``: before any step), and when no engine is busy and the stream is
  open the intake awaits the next message. `Source.take` submits through
  `EngineLoop.submit` (dispatch, then the engine) and aborts through
  `EngineLoop.abort`; it returns once it took what was due.
- the pacing (``pace``, awaited with each step's end clock after the step): none
  (simulate at full speed), `WallPacer.sleep_until` (simulate paced), or serve's,
  which keeps the lag and, unpaced, only checkpoints so the handlers run between steps.
- the output hook (``on_step``, after the pacing): simulate settles the finished
  requests (arrivals, dispatcher) and reports progress; serve turns the step's
  outputs into the requests' outboxes, metrics and gauges.

Dispatch is always the one `kvpool.engine.dispatch.Dispatcher`: `submit` asks it for
the engine and tells it of the change (or of the rejection).

Fast-forward (``fast_forward``): before stepping an engine the loop asks it to jump
over the decode-only steps that start before the next arrival (`MockEngine.fast_forward`,
see `kvpool.engine.simulation` for why that is identical to stepping), and, when
settling may release further requests (``Source.reactive``), before the next busy
engine's clock too; ``cross_boundaries=False`` (a paced run) keeps a jump from
publishing an event batch before its time. While no settling can release a request, a
jump that finishes requests may go on past them, jump after jump, in one KV call
(`MockEngine.fast_forward`'s ``chain``). A jump's hook gets no `StepResult` (None).

Invariants: an engine is on the heap (``_queued``) iff it has work, and its key is its
current clock (a busy engine's clock moves only when it steps, and it is off the heap
while it steps; `abort` takes an engine that went idle off). ``cutoff`` stops the
clock: no step starts at or after it, and the loop ends then even if work remains.

setup.py compiles this module with mypyc: a turn's calls into the engine, the source and
the hook are then direct calls (the engine's `step` excepted: see `_step`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from kvpool.engine.dispatch import Dispatcher
from kvpool.engine.engine import MockEngine, StepResult
from kvpool.workloads import RequestSpec

StepHook = Callable[[int, MockEngine, "StepResult | None"], Awaitable[None]]
"""Awaited after each step (and its pacing) as ``(engine index, engine, result)``;
``result`` is None after a fast-forward jump."""


class Source(Protocol):
    """Where an `EngineLoop`'s requests come from (see the module docstring)."""

    @property
    def reactive(self) -> bool:
        """Whether a request that settles may release another (closed loop, sessions)."""
        ...

    def next_arrival(self) -> float | None:
        """The simulated time the next known arrival is due (``-inf``: at once), or None
        when none is known now (and, if no engine is busy, none will come)."""
        ...

    async def take(self, loop: EngineLoop) -> None:
        """Hand ``loop`` what is due (`EngineLoop.submit`, `EngineLoop.abort`)."""
        ...


class EngineLoop:
    """Steps ``engines`` with requests from a `Source` (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[MockEngine],
        dispatcher: Dispatcher,
        *,
        fast_forward: bool = False,
        cross_boundaries: bool = True,
        cutoff: float = math.inf,
        pace: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.engines = engines
        self.dispatcher = dispatcher
        self.fast_forward = fast_forward
        self.cross_boundaries = cross_boundaries
        self.cutoff = cutoff
        self.pace = pace
        # (clock, rank, index) of each busy engine, earliest first
        self._busy: list[tuple[float, int, int]] = []
        self._queued = [False] * len(engines)

    async def run(self, source: Source, on_step: StepHook | None = None) -> None:
        """Take and step until the source has nothing more and no engine is busy, or
        the earliest busy clock reached ``cutoff``. Jumps carry their allocations to the
        engine's next KV call (`MockEngine.fast_forward`'s ``carry``: a jump to an
        arrival costs no call of its own, nor does a chain of jumps that finish
        requests); the engines are settled when it stops.
        Cancellation stops it between two engine calls; the engines keep their partial
        state (a carried jump included, sent with their next KV call)."""
        engines = self.engines
        busy = self._busy = [(e.clock, e.rank, i) for i, e in enumerate(engines) if e.has_work]
        heapq.heapify(busy)
        queued = self._queued = [False] * len(engines)
        for _, _, index in busy:
            queued[index] = True
        cutoff = self.cutoff
        fast_forward = self.fast_forward
        cross = self.cross_boundaries
        pace = self.pace
        while True:
            when = source.next_arrival()
            if when is not None and when < cutoff and (not busy or when <= busy[0][0]):
                await source.take(self)
                continue
            if not busy or busy[0][0] >= cutoff:
                for idle in engines:  # a jump's allocations left to a next call: now
                    await idle.settle()
                break
            _, _, index = heapq.heappop(busy)
            engine = engines[index]
            # A step is taken only if it starts before the next arrival (ties: the
            # arrival first), so a jump may cover only such steps. While a request that
            # settles may release another, no jump may pass another busy engine's clock
            # either: its next step may end with such a release.
            result: StepResult | None = None
            if fast_forward:
                until = cutoff if when is None else min(when, cutoff)
                if busy and source.reactive:  # read each time: it changes as requests go
                    until = min(until, busy[0][0])
                jumped = await engine.fast_forward(
                    until, cross_boundaries=cross, carry=True, chain=not source.reactive
                )
                if not jumped:
                    result = await _step(engine)
            else:
                result = await _step(engine)
            if engine.has_work:
                heapq.heappush(busy, (engine.clock, engine.rank, index))
            else:
                queued[index] = False
            if pace is not None:
                await pace(engine.clock)
            if on_step is not None:
                await on_step(index, engine, result)

    async def submit(self, spec: RequestSpec, when: float | None) -> tuple[int, bool]:
        """Send ``spec``, arriving at simulated ``when`` (None: at the chosen engine's
        clock), to the engine the dispatcher chooses (an idle one's clock jumps to
        ``when``); return its index and whether it accepted ``spec`` (if not, the
        dispatcher is told it settled). A dispatcher that reads the engines' active
        blocks reads them exact (`MockEngine.settle_usage`)."""
        dispatcher = self.dispatcher
        now = when if when is not None else max(engine.clock for engine in self.engines)
        if dispatcher.reads_usage:
            for busy in self.engines:
                await busy.settle_usage()
        index = dispatcher.choose(spec, now)
        engine = self.engines[index]
        if when is not None:
            engine.advance_to(when)
        if not await engine.submit(spec, when):
            dispatcher.settled(index, spec.request_id, now)
            return index, False
        dispatcher.changed(index)
        if not self._queued[index]:
            heapq.heappush(self._busy, (engine.clock, engine.rank, index))
            self._queued[index] = True
        return index, True

    async def abort(self, index: int, request_id: str) -> bool:
        """Drop ``request_id`` from engine ``index`` (see `MockEngine.abort`); an engine
        left idle leaves the heap."""
        engine = self.engines[index]
        if not await engine.abort(request_id):
            return False
        self.dispatcher.changed(index)
        if self._queued[index] and not engine.has_work:
            busy = self._busy  # in place: `run` holds it
            busy[:] = [entry for entry in busy if entry[2] != index]
            heapq.heapify(busy)
            self._queued[index] = False
        return True


async def _step(engine: MockEngine) -> StepResult:
    """``engine.step()``, the method read off the engine's class at each call as
    interpreted code reads it: setup.py compiles this module, and a compiled call would
    go to `MockEngine.step` directly, past a wrapper put on the class (a test counting
    the steps taken one at a time puts one there)."""
    return await type(engine).step(engine)


__all__ = ["EngineLoop", "Source", "StepHook"]
