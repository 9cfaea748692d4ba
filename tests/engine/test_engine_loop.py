"""The one engine loop (`kvpool.engine.loop.EngineLoop`) driven by hand-made sources: what
it steps, when it takes arrivals, what an abort and a cutoff do to its heap of busy
engines."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest

from kvpool.engine import EngineConfig, LocalKvClient, MockEngine, StepResult
from kvpool.engine.dispatch import bind, make_policy
from kvpool.engine.loop import EngineLoop
from kvpool.events import KVEvent
from kvpool.routing import WorkerLoad
from kvpool.workloads import RequestSpec, Segment

pytestmark = pytest.mark.anyio


def spec(request_id: str, prompt: int = 20, output: int = 3) -> RequestSpec:
    prompt_seed = zlib.crc32(request_id.encode())
    return RequestSpec(request_id, 0.0, (Segment(prompt_seed, prompt),), Segment(7, output))


def fleet(n: int) -> list[MockEngine]:
    return [
        MockEngine(LocalKvClient.create(64, 16), EngineConfig(num_gpu_blocks=64), rank=r)
        for r in range(n)
    ]


class Timed:
    """A source of requests at given simulated times, recording what the loop did."""

    def __init__(self, arrivals: list[tuple[float, RequestSpec]]) -> None:
        self.arrivals = arrivals
        self.taken: list[tuple[str, int, float]] = []  # (request, engine, busy clocks' min)

    @property
    def reactive(self) -> bool:
        return False

    def next_arrival(self) -> float | None:
        return self.arrivals[0][0] if self.arrivals else None

    async def take(self, loop: EngineLoop) -> None:
        when, request = self.arrivals.pop(0)
        index, accepted = await loop.submit(request, when)
        assert accepted
        self.taken.append((request.request_id, index, when))


async def test_an_arrival_is_taken_once_every_busy_engine_reached_it() -> None:
    engines = fleet(2)
    arrivals = [(0.0, spec("a")), (0.0, spec("b")), (0.05, spec("c")), (0.3, spec("d"))]
    source = Timed(list(arrivals))
    steps: list[tuple[int, float, float]] = []  # (engine, start, end) of each step
    clocks_at_take: list[float] = []

    async def on_step(index: int, engine: MockEngine, result: StepResult | None) -> None:
        assert result is not None
        steps.append((index, result.clock - result.duration_s, result.clock))

    loop = EngineLoop(engines, bind(make_policy("round-robin"), engines))
    original_take = source.take

    async def take(loop_: EngineLoop) -> None:
        busy = [engine.clock for engine in engines if engine.has_work]
        clocks_at_take.append(min(busy, default=math.inf))
        await original_take(loop_)

    source.take = take  # type: ignore[method-assign]
    await loop.run(source, on_step)
    assert [t[0] for t in source.taken] == ["a", "b", "c", "d"]
    assert [t[1] for t in source.taken] == [0, 1, 0, 1]  # round robin
    # every arrival came when no busy engine's clock was still before it
    for (when, _), earliest in zip(arrivals, clocks_at_take, strict=True):
        assert earliest >= when
    assert all(not engine.has_work for engine in engines)
    assert sum(engine.stats.completed for engine in engines) == 4
    assert steps, "the loop stepped nothing"


class Once:
    """Submits one request, and aborts it after the engine's first step."""

    def __init__(self) -> None:
        self.sent = False

    @property
    def reactive(self) -> bool:
        return False

    def next_arrival(self) -> float | None:
        return None if self.sent else 0.0

    async def take(self, loop: EngineLoop) -> None:
        self.sent = True
        assert (await loop.submit(spec("only", prompt=40, output=50), 0.0))[1]


async def test_aborting_the_only_request_takes_its_engine_off_the_heap() -> None:
    engines = fleet(1)
    loop = EngineLoop(engines, bind(make_policy("round-robin"), engines))
    stepped = 0

    async def on_step(index: int, engine: MockEngine, result: StepResult | None) -> None:
        nonlocal stepped
        stepped += 1
        if stepped == 2:
            assert await loop.abort(0, "only")
            assert not await loop.abort(0, "only")  # gone already

    await loop.run(Once(), on_step)
    # without the abort the request would decode 50 tokens over 50 more steps; an idle
    # engine left on the heap would be stepped again (or the loop would never end)
    assert stepped == 2
    assert not engines[0].has_work
    assert (await engines[0].final_usage()).num_active == 0


async def test_no_step_starts_at_or_after_the_cutoff() -> None:
    engines = fleet(2)
    source = Timed([(0.0, spec("a", output=400)), (0.0, spec("b", output=400))])
    starts: list[float] = []

    async def on_step(index: int, engine: MockEngine, result: StepResult | None) -> None:
        assert result is not None
        starts.append(result.clock - result.duration_s)

    cutoff = 0.5
    loop = EngineLoop(engines, bind(make_policy("round-robin"), engines), cutoff=cutoff)
    await loop.run(source, on_step)
    assert starts
    assert max(starts) < cutoff
    assert any(engine.has_work for engine in engines)  # stopped with work left
    assert min(engine.clock for engine in engines) >= cutoff


async def test_fast_forward_ends_with_the_same_engines_as_stepping() -> None:
    def arrivals() -> list[tuple[float, RequestSpec]]:
        return [(0.01 * i, spec(f"r{i}", prompt=30 + i, output=20 + 7 * i)) for i in range(8)]

    finals = []
    for fast_forward in (False, True):
        engines = fleet(2)
        loop = EngineLoop(
            engines, bind(make_policy("round-robin"), engines), fast_forward=fast_forward
        )
        await loop.run(Timed(arrivals()))
        finals.append([(e.clock, e.stats.completed, e.stats.generated_tokens) for e in engines])
    assert finals[0] == finals[1]


class Recording:
    """Least-loaded by active blocks, recording the loads it was shown at each choice."""

    uses_kv_events = False

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        self.seen.append([load.active_blocks for load in loads])
        return min(loads, key=lambda load: (load.active_blocks, load.index)).index

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        pass

    def finished(self, worker: int, request_id: str, now: float) -> None:
        pass


async def test_a_router_reads_the_loads_stepping_would_show_it() -> None:
    """Jumps that finish requests may leave their frees to the next step's call (a
    carried chain, whose active count is an upper bound until then): a router reading
    the loads at an arrival sees the exact counts all the same, the ones stepping shows
    it, and chooses alike."""

    def arrivals() -> list[tuple[float, RequestSpec]]:
        return [
            (0.2 * i, spec(f"r{i}", prompt=20 + 9 * (i % 4), output=3 + 11 * (i % 5)))
            for i in range(16)
        ]

    seen = []
    finals = []
    for fast_forward in (False, True):
        engines = fleet(2)
        policy = Recording()
        loop = EngineLoop(engines, bind(policy, engines), fast_forward=fast_forward)
        await loop.run(Timed(arrivals()))
        seen.append(policy.seen)
        finals.append([(e.clock, e.stats.completed, e.stats.generated_tokens) for e in engines])
        if fast_forward:
            assert sum(engine.jumps for engine in engines) > 0
    assert seen[0] == seen[1]
    assert finals[0] == finals[1]


def carried_state(engines: list[MockEngine]) -> list[tuple[object, ...]]:
    """What a run leaves in its engines: clocks, stats, samples and records."""
    return [
        (
            e.clock,
            e.stats.completed,
            e.stats.generated_tokens,
            e.stats.steps,
            list(e.stats.sample_times),
            list(e.stats.usage),
            [(r.request_id, r.finish_s) for r in e.stats.requests],
        )
        for e in engines
    ]


@pytest.mark.parametrize(("stop_after", "chain_carried"), [(1, False), (2, True), (8, True)])
async def test_a_run_cancelled_between_calls_resumes_as_if_never_stopped(
    stop_after: int, chain_carried: bool
) -> None:
    """Cancelled between two engine calls, after a step or right after a chain of
    finishing jumps left its call to the next step, and run again: the engine sends
    what it carried with its next KV call, and the run ends as an uninterrupted one."""

    def arrivals() -> list[tuple[float, RequestSpec]]:
        # bursts of three that finish at different steps, some after the next burst
        return [
            (0.3 * (i // 3), spec(f"r{i}", prompt=20 + 7 * (i % 3), output=5 + 40 * (i % 3)))
            for i in range(12)
        ]

    def loop_over(engines: list[MockEngine]) -> EngineLoop:
        return EngineLoop(engines, bind(make_policy("round-robin"), engines), fast_forward=True)

    engines = fleet(1)
    await loop_over(engines).run(Timed(arrivals()))
    expected = carried_state(engines)

    engines = fleet(1)
    loop = loop_over(engines)
    source = Timed(arrivals())
    calls = 0
    bounded: list[bool] = []

    async def on_step(index: int, engine: MockEngine, result: StepResult | None) -> None:
        nonlocal calls
        calls += 1
        if calls == stop_after:
            # a carried chain's frees are not in the engine's count yet
            bounded.append(engine.num_active_blocks > (await engine.kv.usage()).num_active)
            scope.cancel()
            await anyio.lowlevel.checkpoint()

    with anyio.CancelScope() as scope:
        await loop.run(source, on_step)
    assert scope.cancelled_caught
    assert bounded == [chain_carried]
    await loop.run(source)
    assert carried_state(engines) == expected
    assert (await engines[0].final_usage()).num_active == 0
