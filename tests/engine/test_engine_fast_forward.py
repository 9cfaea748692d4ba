"""Fast-forward: `MockEngine.fast_forward` jumps over the pure decode steps in
closed form, and a run is identical to stepping one step at a time.

Identical means ``==``, floats bitwise: the report (less wall time and settings), the
per-request records, every KV event batch (``ts`` included) and every engine's clock,
under every flag combination, KV backend and timing model (a custom one whose step time
moves within a jump included). Engine-level twins check each jump step by step: every
step it covers is a pure decode step that starts before ``until``, and a jump never stops
short of one (0 means the next step is not one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from kvpool import cli
from kvpool.engine import (
    KV_BACKENDS,
    Dispatch,
    Dynamo16Timing,
    DynamoTiming,
    EngineConfig,
    LocalKvClient,
    MockEngine,
    PreemptionMode,
    ProfileTiming,
    StepTiming,
    StepWork,
    TimingModel,
    build_report,
    run_simulation,
)
from kvpool.engine import runner as runner_module
from kvpool.engine.kv_client import TimedKvClient
from kvpool.engine.request import EngineRequest
from kvpool.events import EventCollector
from kvpool.manager import (
    AdmissionGate,
    DecodeRun,
    KvManager,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepSchedule,
    StepUpdate,
    StretchAllocations,
)
from kvpool.pool import BlockPool
from kvpool.workloads import RequestSpec, Segment, mix_seed

# ------------------------------------------------------------------ timing models


@dataclass(frozen=True, slots=True)
class ContextTiming:
    """A custom model: the step time grows with the sampled context and the pool's
    occupancy, so it changes from one step to the next within a jump."""

    def duration(self, work: StepWork) -> float:
        return (
            1.3e-3
            + 1.7e-6 * work.context_tokens
            + 2.3e-5 * work.active_blocks
            + 4.1e-6 * work.prefill_tokens
            + 3.1e-5 * work.decode_seqs
        )


@dataclass(frozen=True, slots=True)
class LinearPlusContext(TimingModel):
    """The linear model's subclass, plus a cost per token of context: a subclass of a
    model whose step time is constant within a jump need not be constant itself."""

    context_token_s: float = 1.1e-6

    def duration(self, work: StepWork) -> float:
        return TimingModel.duration(self, work) + self.context_token_s * work.context_tokens


PROFILE = ProfileTiming(
    prefill_isl=(1.0, 64.0, 512.0),
    prefill_ttft_ms=(3.0, 7.5, 41.0),
    decode_active_kv_tokens=(0.0, 128.0, 1024.0),
    decode_context_length=(1.0, 32.0, 256.0),
    decode_itl=((1.5, 2.0, 4.0), (2.5, 3.25, 6.0), (4.0, 5.5, 9.0)),
)
GRID = 2.0**-10  # every step of DYADIC ends on this grid: arrivals on it tie with step ends
DYADIC = TimingModel(step_overhead_s=4 * GRID, prefill_token_s=GRID, decode_seq_s=GRID)
TIMINGS: dict[str, StepTiming] = {
    "linear": TimingModel(),
    "dyadic": DYADIC,
    "dynamo": DynamoTiming(),
    "dynamo-1.6": Dynamo16Timing(),
    "profile": PROFILE,
    "context": ContextTiming(),
    "linear+context": LinearPlusContext(),
}
STEP = TimingModel(step_overhead_s=0.25, prefill_token_s=0.0, decode_seq_s=0.0)
"""Targeted tests: every step lasts 0.25 s exactly, so step k starts at 0.25 * (k - 1)."""

EPOCH = 1_750_000_000.0
"""`run_simulation` stamps batches from ``time.time()`` at its start: pinned, so two runs'
``ts`` compare exactly."""

# ------------------------------------------------------------------ KV backends


class OneSlotKv(LocalKvClient):
    """The manager as the engine used it before a step's allocations shared a call:
    each step alone, each slot alone, in order, until one does not fit, and no
    admission-cost probe (the engine then asks `prefill_cost` itself)."""

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        manager = self.manager
        results = []
        for slots in steps:
            allocations, events = [], []
            for slot in slots:
                outcome = manager.allocate_step([slot])
                events.extend(outcome.events)
                if not outcome.allocations:
                    break
                allocations.extend(outcome.allocations)
            stopped = len(allocations) < len(slots)
            cost = None
            if stop_if_cost_changes is not None:  # the engine asks only with a probe
                assert probe is not None
                cost = manager.prefill_cost(probe)
                stopped = stopped or cost != stop_if_cost_changes
            results.append(
                StepAllocations(allocations, events + manager.take_events(), manager.stats(), cost)
            )
            if stopped:
                break
        return results

    async def allocate_run(
        self,
        run: DecodeRun,
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> RunAllocations:
        """The steps of the stretch the run stands for, one slot at a time as above."""
        stretch = run.stretch(self.block_size)
        results = await self.allocate_steps(
            stretch.steps(), probe, stop_if_cost_changes=stop_if_cost_changes
        )
        return RunAllocations.of_stretch(stretch, StretchAllocations.of_steps(results))


class CountingSteps(LocalKvClient):
    """Records each `allocate_steps`, `schedule`, `allocate_run` and `finish_run` call:
    per step, its (running) slots' token counts."""

    def __init__(self, manager: KvManager) -> None:
        super().__init__(manager)
        self.calls: list[list[list[int]]] = []

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        self.calls.append([[slot.num_tokens for slot in slots] for slots in steps])
        return await super().allocate_steps(steps, probe, stop_if_cost_changes=stop_if_cost_changes)

    async def schedule(
        self,
        slots: list[SlotRequest],
        queue: list[QueuedRequest],
        gate: AdmissionGate,
        run: DecodeRun | None = None,
    ) -> StepSchedule:
        steps = [] if run is None else run.stretch(self.block_size).steps()
        self.calls.append([[slot.num_tokens for slot in step] for step in [*steps, slots]])
        return await super().schedule(slots, queue, gate, run)

    async def allocate_run(
        self,
        run: DecodeRun,
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> RunAllocations:
        self.calls.append(
            [[slot.num_tokens for slot in slots] for slots in run.stretch(self.block_size).steps()]
        )
        return await super().allocate_run(run, probe, stop_if_cost_changes=stop_if_cost_changes)

    async def finish_run(
        self, run: DecodeRun, updates: list[StepUpdate]
    ) -> tuple[RunAllocations, StepOutcome]:
        self.calls.append(
            [[slot.num_tokens for slot in slots] for slots in run.stretch(self.block_size).steps()]
        )
        return await super().finish_run(run, updates)


@asynccontextmanager
async def open_one_slot_kv(config: EngineConfig, rank: int = 0) -> AsyncIterator[OneSlotKv]:
    pool = BlockPool(config.num_gpu_blocks)
    yield OneSlotKv(
        KvManager(pool, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
    )


BACKENDS = {**KV_BACKENDS, "one-slot": open_one_slot_kv}


# ------------------------------------------------------------------ strategies

SHARED = (Segment(7001, 5), Segment(7002, 12), Segment(7003, 17))  # prefixes worth re-hitting
PREFIXES: tuple[tuple[Segment, ...], ...] = (
    (),
    *((segment,) for segment in SHARED),
    (SHARED[0], SHARED[1]),
)


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 10) -> list[RequestSpec]:
    """Requests by arrival: shared prefixes (some whole prompts repeat), follow-up turns
    (an earlier request's prompt and part of its output, then their own tokens: their
    cost falls as the earlier one's blocks fill), outputs of 1-40 tokens, arrivals
    together and apart, all on `GRID` (exact ties with DYADIC's step ends) or
    anywhere."""
    gaps = st.one_of(
        st.just(0.0),
        st.just(0.0),
        st.integers(1, 16).map(lambda k: k * GRID),
        st.integers(1, 200).map(lambda k: k * GRID),
    )
    if not draw(st.booleans()):
        gaps = st.one_of(gaps, st.floats(0.0, 0.2, allow_nan=False, allow_infinity=False))
    requests = []
    arrival = 0.0
    for i in range(draw(st.integers(1, max_requests))):
        arrival += draw(gaps)
        prefix = draw(st.sampled_from(PREFIXES))
        own_seed = draw(st.sampled_from([8001, 8002, mix_seed(50_000, i)]))
        own = Segment(own_seed, draw(st.integers(0 if prefix else 1, 16)))
        output = Segment(
            mix_seed(90_000, i), draw(st.one_of(st.integers(1, 40), st.integers(24, 40)))
        )
        if requests and draw(st.integers(0, 3)) == 0:
            earlier = draw(st.sampled_from(requests))
            said = Segment(earlier.output.seed, draw(st.integers(1, earlier.output.length)))
            prefix = (*earlier.prompt, said)
        requests.append(RequestSpec(f"r{i}", arrival, (*prefix, own), output))
    return requests


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    """Small pools (preemption, eviction) and budgets (chunks, refusals), every flag."""
    block_size = draw(st.sampled_from([2, 4, 8, 16]))
    # tight (preemptions, evictions) to roomy for the requests drawn
    pool_tokens = draw(st.one_of(st.integers(48, 128), st.integers(48, 320)))
    chunked = draw(st.booleans())
    # without chunked prefill a prompt must fit one step's budget, or it is rejected
    budget = st.integers(24, 128) if not chunked else st.sampled_from([2, 3, 5, 8])
    return EngineConfig(
        num_gpu_blocks=min(64, max(8, pool_tokens // block_size)),
        block_size=block_size,
        max_num_seqs=draw(st.one_of(st.integers(1, 8), st.integers(3, 8))),
        max_num_batched_tokens=draw(st.one_of(st.integers(8, 64), budget)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        preemption_mode=draw(st.sampled_from(["lifo", "fifo"])),
        timing=TIMINGS[draw(st.sampled_from(sorted(TIMINGS)))],
    )


DISPATCH: list[Dispatch] = ["least-loaded", "round-robin"]

# ------------------------------------------------------------------ whole runs


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a run shows: report parts, records, event batches and clocks per engine (as
    builtins, so a mismatch diffs field by field), and how often `MockEngine.step` ran."""

    simulated_s: float
    workers: list[Any]
    total: Any
    records: list[Any]
    batches: list[Any]
    clocks: list[float]
    step_calls: int
    jumped_steps: int  # the engines' own count (`MockEngine.jumped_steps`)


def simulate(
    requests: Sequence[RequestSpec],
    config: EngineConfig,
    *,
    fast_forward: bool,
    workers: int = 1,
    dispatch: Dispatch = "least-loaded",
    backend: str = "local",
    speedup_ratio: float = 0.0,
    loop: str = "asyncio",
) -> Outcome:
    """`run_simulation` with a recording sink per worker (none with KV cache events off),
    ``MockEngine.step`` counted."""
    recording = config.enable_kv_cache_events
    collectors = [EventCollector() for _ in range(workers)] if recording else []
    sinks = collectors if recording else None
    calls = 0
    step = MockEngine.step

    async def counted(engine: MockEngine) -> Any:
        nonlocal calls
        calls += 1
        return await step(engine)

    async def main() -> Any:
        return await run_simulation(
            requests,
            config,
            workers=workers,
            dispatch=dispatch,
            speedup_ratio=speedup_ratio,
            fast_forward=fast_forward,
            kv_factory=BACKENDS[backend],
            sinks=sinks,
        )

    clock = types.SimpleNamespace(time=lambda: EPOCH)
    with (
        mock.patch.object(runner_module, "time", clock),
        mock.patch.object(MockEngine, "step", counted),
    ):
        run = anyio.run(main, backend=loop)
    report = run.report
    return Outcome(
        simulated_s=report.simulated_s,
        workers=msgspec.to_builtins(report.workers),
        total=msgspec.to_builtins(report.total),
        records=[msgspec.to_builtins(engine.stats.requests) for engine in run.engines],
        batches=[msgspec.to_builtins(sink.batches) for sink in collectors],
        clocks=[engine.clock for engine in run.engines],
        step_calls=calls,
        jumped_steps=sum(engine.jumped_steps for engine in run.engines),
    )


def assert_same_run(fast: Outcome, slow: Outcome) -> None:
    """Everything but the count of `MockEngine.step` calls is identical."""
    assert fast.simulated_s == slow.simulated_s
    assert fast.clocks == slow.clocks
    assert fast.total == slow.total
    assert fast.workers == slow.workers
    assert fast.records == slow.records
    assert fast.batches == slow.batches
    assert slow.step_calls == slow.total["steps"]
    assert fast.step_calls <= slow.step_calls
    # every step is a single step or one of a jump's, as the engine counts its jumps
    assert fast.step_calls + fast.jumped_steps == fast.total["steps"]
    assert slow.jumped_steps == 0


def label(fast: Outcome) -> None:
    """Report what the example exercised, and steer generation towards pressure."""
    total = fast.total
    target(float(min(total["preemptions"], 10)), label="preemptions")
    target(float(min(total["evictions"], 10)), label="evictions")
    target(float(min(total["steps"] - fast.step_calls, 100)), label="steps jumped")
    event(f"jumped: {fast.step_calls < total['steps']}")
    event(f"preempted: {total['preemptions'] > 0}")
    event(f"evicted: {total['evictions'] > 0}")
    event(f"rejected: {total['requests_rejected'] > 0}")


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(),
    config=configs(),
    workers=st.integers(1, 3),
    dispatch=st.sampled_from(DISPATCH),
    backend=st.sampled_from(sorted(KV_BACKENDS)),
)
def test_random_runs_are_identical_with_and_without_fast_forward(
    requests: list[RequestSpec],
    config: EngineConfig,
    workers: int,
    dispatch: Dispatch,
    backend: str,
) -> None:
    """Random workloads, every flag, backend and timing model: the same run either way."""
    kwargs: dict[str, Any] = {"workers": workers, "dispatch": dispatch, "backend": backend}
    fast = simulate(requests, config, fast_forward=True, **kwargs)
    slow = simulate(requests, config, fast_forward=False, **kwargs)
    label(fast)
    assert_same_run(fast, slow)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(),
    config=configs(),
    workers=st.integers(1, 3),
    backend=st.sampled_from(sorted(KV_BACKENDS)),
    fast_forward=st.booleans(),
)
def test_runs_that_build_no_kv_events_report_the_same(
    requests: list[RequestSpec],
    config: EngineConfig,
    workers: int,
    backend: str,
    fast_forward: bool,
) -> None:
    """With ``enable_kv_cache_events`` off (what `kvpool simulate` runs without a
    publisher) nothing is built, and the report, the records and the clocks are exactly
    those of a run that publishes: the batches are counted all the same."""
    kwargs: dict[str, Any] = {"workers": workers, "backend": backend}
    recorded = simulate(requests, config, fast_forward=fast_forward, **kwargs)
    silent_config = dataclasses.replace(config, enable_kv_cache_events=False)
    silent = simulate(requests, silent_config, fast_forward=fast_forward, **kwargs)
    assert silent.batches == []
    assert silent.total["kv_event_batches"] == sum(len(b) for b in recorded.batches)
    assert dataclasses.replace(silent, batches=recorded.batches) == recorded


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(),
    config=configs(),
    workers=st.integers(1, 2),
    fast_forward=st.booleans(),
)
def test_a_steps_allocations_in_one_call_are_its_slots_one_at_a_time(
    requests: list[RequestSpec], config: EngineConfig, workers: int, fast_forward: bool
) -> None:
    """A step's allocations share one `allocate_step` call, and the queue head's cost
    rides on it: the run is the one the manager gives slot by slot, asked separately."""
    kwargs: dict[str, Any] = {"workers": workers, "fast_forward": fast_forward}
    batched = simulate(requests, config, backend="local", **kwargs)
    one_by_one = simulate(requests, config, backend="one-slot", **kwargs)
    label(batched)
    assert batched == one_by_one  # the step count too: both take the same path


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(max_requests=4),
    config=configs(),
    workers=st.integers(1, 2),
    backend=st.sampled_from(sorted(KV_BACKENDS)),
)
def test_paced_runs_are_identical_with_and_without_fast_forward(
    requests: list[RequestSpec], config: EngineConfig, workers: int, backend: str
) -> None:
    """Paced (speedup_ratio > 0, ts on the wall-clock scale): the same run either way."""
    kwargs: dict[str, Any] = {"workers": workers, "backend": backend, "speedup_ratio": 1e6}
    fast = simulate(requests, config, fast_forward=True, **kwargs)
    slow = simulate(requests, config, fast_forward=False, **kwargs)
    assert_same_run(fast, slow)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(max_requests=5),
    config=configs(),
    workers=st.integers(1, 2),
    backend=st.sampled_from(sorted(KV_BACKENDS)),
    data=st.data(),
)
def test_arrivals_exactly_at_step_ends_are_identical_with_and_without_fast_forward(
    requests: list[RequestSpec],
    config: EngineConfig,
    workers: int,
    backend: str,
    data: st.DataObject,
) -> None:
    """Requests arriving exactly when a step ends (the arrival goes first, so the jump
    before it must stop there): the same run either way, whatever the timing model."""
    ends: list[float] = []

    async def first_pass() -> None:
        await run_simulation(
            requests,
            config,
            workers=workers,
            fast_forward=False,
            on_progress=lambda done, total, clock: ends.append(clock),
        )

    anyio.run(first_pass, backend="asyncio")
    times = data.draw(st.lists(st.sampled_from(sorted(set(ends))), min_size=1, max_size=3))
    extra = [
        RequestSpec(f"x{i}", t, (SHARED[i % 3], Segment(mix_seed(60_000, i), 3)), Segment(i, 9))
        for i, t in enumerate(times)
    ]
    merged = sorted([*requests, *extra], key=lambda spec: spec.arrival_s)
    kwargs: dict[str, Any] = {"workers": workers, "backend": backend}
    fast = simulate(merged, config, fast_forward=True, **kwargs)
    slow = simulate(merged, config, fast_forward=False, **kwargs)
    label(fast)
    assert_same_run(fast, slow)


def long_outputs(timing: StepTiming) -> tuple[list[RequestSpec], EngineConfig]:
    """Three requests decoding 600 tokens each, in phase, in large blocks; a fourth arrives
    mid-decode and shares the first one's prompt."""
    prompt = Segment(4242, 150)  # two full blocks: "late" hits them
    requests = [
        RequestSpec(f"long{i}", 0.0, (Segment(mix_seed(5, i), 150),), Segment(mix_seed(6, i), 600))
        for i in range(3)
    ]
    requests.insert(0, RequestSpec("first", 0.0, (prompt,), Segment(77, 600)))
    requests.append(RequestSpec("late", 1.0, (prompt,), Segment(78, 300)))
    config = EngineConfig(num_gpu_blocks=256, block_size=64, timing=timing)
    return requests, config


@pytest.mark.parametrize("timing", sorted(TIMINGS))
@pytest.mark.parametrize(
    ("backend", "loop"), [("local", "asyncio"), ("actor", "asyncio"), ("actor", "trio")]
)
def test_long_decodes_are_jumped_over_not_stepped(timing: str, backend: str, loop: str) -> None:
    """Long decodes: `MockEngine.step` runs a small fraction of the steps counted, with
    results identical to stepping each one (fails if fast_forward is a no-op)."""
    requests, config = long_outputs(TIMINGS[timing])
    fast = simulate(requests, config, fast_forward=True, backend=backend, loop=loop)
    slow = simulate(requests, config, fast_forward=False, backend=backend, loop=loop)
    assert_same_run(fast, slow)
    steps = fast.total["steps"]
    assert steps >= 600
    # a step is needed only at a prefill, an arrival, a block boundary or a finish
    assert fast.step_calls * 8 < steps, (fast.step_calls, steps)
    assert fast.total["prefix_cache_hits"] > 0  # "late" reuses the first prompt


# ------------------------------------------------------------------ engine twins


def local_engine(config: EngineConfig, sink: EventCollector | None = None) -> MockEngine:
    kv = LocalKvClient.create(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    return MockEngine(kv, config, sink=sink)


def request_state(request: EngineRequest) -> tuple[object, ...]:
    """A request's scheduling state (not its pending tokens: when they reach the manager
    is the engine's business)."""
    return (
        request.request_id,
        request.arrival_s,
        request.num_tokens,
        request.num_computed,
        request.num_blocks,
        request.num_output,
        request.num_preemptions,
        request.cached_tokens,
        request.first_scheduled_s,
        request.first_token_s,
        request.last_token_s,
        request.finish_s,
    )


async def snapshot(engine: MockEngine, sink: EventCollector) -> dict[str, Any]:
    """Everything observable of an engine between steps, as builtins."""
    usage = await engine.kv.usage()
    report = build_report([engine], [usage], workload="", settings={}, wall_s=0.0)
    return {
        "clock": engine.clock,
        "running": [request_state(r) for r in engine.running],
        "waiting": [request_state(r) for r in engine.waiting],
        "active_blocks": engine.num_active_blocks,
        "usage": msgspec.to_builtins(usage),
        "manager": msgspec.to_builtins(await engine.kv.stats()),
        "report": msgspec.to_builtins(report),
        "records": msgspec.to_builtins(engine.stats.requests),
        "rejected": list(engine.rejected_ids),
        "batches": msgspec.to_builtins(sink.batches),
    }


async def step_is_pure(
    engine: MockEngine,
    until: float,
    *,
    strict: bool,
    cross: bool = True,
    last: bool = False,
    finishing: bool = False,
) -> bool:
    """Step ``engine``; True if that was a pure decode step starting before ``until``.

    Pure: every request scheduled was running and decodes its one token, with no
    finish, no preemption and no admission, and - unless ``cross`` - no allocation and
    no block filling (with prefix caching: it would turn cache-visible); ``strict``:
    every running request scheduled (the token budget does not bind). With ``cross``
    and ``last`` (the last step of a jump that crossed boundaries) the step may admit
    after its running requests: a jump watching the queue's head ends with the step
    whose allocations changed the head's cost (and an admitted request may finish).
    With ``cross`` and ``finishing`` (the last step of a jump, or a step the engine
    took alone) a step that began with nobody waiting may finish running requests: a
    jump then ends with the step in which they sample their last token.
    """
    config = engine.config
    caching = config.enable_prefix_caching
    block_size = config.block_size
    start = engine.clock
    before = [(r, r.num_tokens, r.num_computed, r.num_blocks, r.num_output) for r in engine.running]
    waiting = len(engine.waiting)
    result = await engine.step()
    ids = [request.request_id for request, *_ in before]
    scheduled = list(result.scheduled)
    admitted = len(engine.waiting) < waiting and cross and last
    finished = set(result.finished)
    if finishing and cross and not waiting:
        finished -= set(ids)  # running requests that sampled their last token
    if admitted:
        finished -= set(scheduled[len(ids) :])  # admitted with one token left to sample
        scheduled = scheduled[: len(ids)]
    decoding = {
        request.request_id
        for request, tokens, computed, blocks, output in before
        if output >= 1
        and computed + 1 == tokens
        and (cross or request.num_blocks == blocks)
        and not (caching and not cross and (computed + 1) % block_size == 0)
    }
    return (
        start < until
        and not result.preempted
        and not finished
        and (admitted or len(engine.waiting) == waiting)
        and (scheduled == ids if strict or admitted else scheduled == ids[: len(scheduled)])
        and all(result.scheduled[request_id] == 1 for request_id in scheduled)
        and set(scheduled) <= decoding
    )


class Twins:
    """Two engines built identically: ``jumper`` fast-forwards, ``stepper`` steps one step
    at a time; after every move both show the same state, stats, records and batches."""

    def __init__(self, config: EngineConfig) -> None:
        self.sinks = (EventCollector(), EventCollector())
        self.jumper = local_engine(config, self.sinks[0])
        self.stepper = local_engine(config, self.sinks[1])
        self.jumps: list[int] = []

    async def submit(self, spec: RequestSpec) -> bool:
        accepted = []
        for engine in (self.jumper, self.stepper):
            engine.advance_to(spec.arrival_s)
            accepted.append(await engine.submit(spec, spec.arrival_s))
        assert accepted[0] == accepted[1]
        await self.check()
        return accepted[0]

    async def abort(self, request_id: str) -> bool:
        aborted = [await engine.abort(request_id) for engine in (self.jumper, self.stepper)]
        assert aborted[0] == aborted[1]
        await self.check()
        return aborted[0]

    async def fast_forward(self, until: float = math.inf, *, cross: bool = True) -> int:
        """Jump ``jumper``; step ``stepper`` as many times, each a pure decode step."""
        taken = await self.jumper.fast_forward(until, cross_boundaries=cross)
        assert taken >= 0
        for index in range(taken):
            last = index == taken - 1
            assert await step_is_pure(
                self.stepper, until, strict=False, cross=cross, last=last, finishing=last
            ), f"step {index + 1} of a jump of {taken} is not a pure decode step"
        await self.check()
        if taken:
            self.jumps.append(taken)
        return taken

    async def step(self, until: float = math.inf, *, cross: bool = True) -> bool:
        """Step both; True if the step was a (strictly) pure decode step before ``until``."""
        await self.jumper.step()
        pure = await step_is_pure(self.stepper, until, strict=True, cross=cross, finishing=True)
        await self.check()
        return pure

    async def advance(self, until: float = math.inf, *, cross: bool = True) -> None:
        """Jump (as often as the jumper takes steps), then step once: a jump that took 0
        leaves a next step that is not a pure decode step before ``until``, unless the
        queue's head is new to the manager (with prefix caching, only the step's
        admission call asks its cost: `MockEngine.fast_forward`)."""
        while await self.fast_forward(until, cross=cross):
            pass
        jumper = self.jumper
        if jumper.has_work and jumper.clock < until:
            unasked = (
                jumper.config.enable_prefix_caching
                and bool(jumper.waiting)
                and not jumper.waiting[0].registered
            )
            pure = await self.step(until, cross=cross)
            assert not pure or unasked, "fast_forward stopped short of a pure step"

    async def run(self, *, cross: bool = True) -> None:
        while self.jumper.has_work:
            await self.advance(cross=cross)

    async def check(self) -> None:
        jumper = await snapshot(self.jumper, self.sinks[0])
        stepper = await snapshot(self.stepper, self.sinks[1])
        assert jumper == stepper


def run_twins(requests: list[RequestSpec], config: EngineConfig) -> Twins:
    """Submit ``requests`` at their arrivals to engine twins, jumping the jumper as far as
    it goes before each arrival; the twins are checked equal after every call."""
    twins = Twins(config)

    async def main() -> None:
        arrivals = deque(requests)
        while arrivals or twins.jumper.has_work:
            until = arrivals[0].arrival_s if arrivals else math.inf
            if arrivals and (not twins.jumper.has_work or until <= twins.jumper.clock):
                await twins.submit(arrivals.popleft())  # ties: the arrival first
            else:
                await twins.advance(until)

    anyio.run(main, backend="asyncio")
    return twins


def test_a_head_whose_prefix_a_running_request_is_writing_is_admitted_as_stepping_does() -> None:
    """The case Hypothesis found: r3's prompt is r0's prompt and output plus one token,
    and the jump's only block-changing step (its last) fills the block that lets r3 in:
    the jump must stop there and admit, as stepping does."""
    r0_output = Segment(1719173403, 10)
    requests = [
        RequestSpec("r0", 0.0, (Segment(7002, 12), Segment(8001, 0)), r0_output),
        RequestSpec("r1", 2**-10, (Segment(8001, 10),), Segment(133004288, 3)),
        RequestSpec("r2", 2**-10, (Segment(8002, 14),), Segment(791128541, 3)),
        RequestSpec(
            "r3",
            2**-10,
            (Segment(7002, 12), Segment(8001, 0), r0_output, Segment(8001, 1)),
            Segment(3569022065, 1),
        ),
        *(
            RequestSpec(f"r{i}", 2**-10, (Segment(8001, 1),), Segment(seed, 1))
            for i, seed in ((4, 3105694246), (5, 2234818545), (6, 2583089869))
        ),
    ]
    config = EngineConfig(
        num_gpu_blocks=26,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=25,
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        enable_kv_cache_events=True,
        preemption_mode="lifo",
        timing=ContextTiming(),
    )
    run_twins(requests, config)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), config=configs())
def test_a_jump_takes_exactly_the_pure_decode_steps_before_the_next_arrival(
    requests: list[RequestSpec], config: EngineConfig
) -> None:
    """Engine twins on random workloads: each jump is pure decode steps that start before
    the next arrival, leaves the same state as stepping, and stops only where one ends."""
    twins = run_twins(requests, config)
    event(f"jumped: {bool(twins.jumps)}")
    event(f"preempted: {twins.stepper.stats.preemptions > 0}")
    target(float(min(twins.stepper.stats.preemptions, 10)), label="preemptions")
    target(float(min(sum(twins.jumps), 100)), label="steps jumped")


# ------------------------------------------------------------------ carried jumps


def counted_engine(config: EngineConfig) -> tuple[MockEngine, TimedKvClient]:
    """A local engine with no sink, its KV calls counted."""
    kv = TimedKvClient(
        LocalKvClient.create(
            config.num_gpu_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
        )
    )
    return MockEngine(kv, config), kv


def own_state(engine: MockEngine) -> tuple[object, ...]:
    """What an engine keeps itself, which a jump moves whether or not its call waits."""
    return (
        engine.clock,
        [request_state(r) for r in engine.running],
        [request_state(r) for r in engine.waiting],
        engine.num_active_blocks,
        msgspec.to_builtins(engine.stats.requests),
    )


async def drive_twins(
    requests: list[RequestSpec],
    twins: tuple[MockEngine, MockEngine],
    jump: Callable[[float], Awaitable[int]],
) -> None:
    """Drive twin engines without a sink alike: each arrival submitted to both once the
    second's clock reaches it, ``jump(until)`` (the next arrival) until it takes no
    step, then a step of each; after each step both show the same manager, stats,
    report and records."""
    first, second = twins
    nothing = EventCollector()
    arrivals = deque(requests)
    while arrivals or second.has_work:
        until = arrivals[0].arrival_s if arrivals else math.inf
        if arrivals and (not second.has_work or until <= second.clock):
            spec = arrivals.popleft()
            for engine in twins:
                engine.advance_to(spec.arrival_s)
                await engine.submit(spec, spec.arrival_s)
            continue
        while await jump(until):
            pass
        if second.has_work and second.clock < until:
            await first.step()
            await second.step()
            assert await snapshot(first, nothing) == await snapshot(second, nothing)


async def drive_carrier(
    requests: list[RequestSpec],
    carrier: tuple[MockEngine, TimedKvClient],
    plain: tuple[MockEngine, TimedKvClient],
    jump: Callable[[float], Awaitable[int]],
) -> None:
    """`drive_twins` of an engine that carries its calls and one that does not, the
    carrier settled at the end: the same manager, stats, report and records, and the
    carrier made no more KV calls."""
    await drive_twins(requests, (carrier[0], plain[0]), jump)
    await carrier[0].settle()
    nothing = EventCollector()
    assert await snapshot(carrier[0], nothing) == await snapshot(plain[0], nothing)
    assert carrier[1].calls <= plain[1].calls


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), config=configs())
def test_a_carried_jump_lands_with_the_next_step_as_if_sent_alone(
    requests: list[RequestSpec], config: EngineConfig
) -> None:
    """Twin engines (`drive_twins`): one jumps with ``carry``, the other without. After
    each jump they keep the same state of their own; after each step (which lands a
    carried jump) and at the end they show the same manager, stats, report and records,
    and the carrier never made more KV calls."""
    carrier, carrier_kv = counted_engine(config)
    plain, plain_kv = counted_engine(config)
    carried = 0

    async def jump(until: float) -> int:
        nonlocal carried
        calls = (carrier_kv.calls, plain_kv.calls)
        taken = await carrier.fast_forward(until, carry=True)
        assert await plain.fast_forward(until) == taken
        # a call the plain jump made and the carrier's did not (yet)
        carried += carrier_kv.calls - calls[0] < plain_kv.calls - calls[1]
        assert own_state(carrier) == own_state(plain)
        return taken

    anyio.run(drive_carrier, requests, (carrier, carrier_kv), (plain, plain_kv), jump)
    event(f"carried: {min(carried, 3)}")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), config=configs())
def test_a_chain_of_jumps_is_the_steps_it_takes(
    requests: list[RequestSpec], config: EngineConfig
) -> None:
    """Twin engines (`drive_twins`): one jumps with ``chain`` (a finishing jump goes on
    past its finish, jump after jump, in one KV call), the other steps one step at a
    time as many steps. After each chain they show the same state, manager, stats,
    report and records, and a call that finished requests at several steps (a chain of
    jumps) made one KV call."""
    chainer, chainer_kv = counted_engine(config)
    plain, _ = counted_engine(config)
    nothing = EventCollector()
    chained = 0

    async def jump(until: float) -> int:
        nonlocal chained
        calls = chainer_kv.calls
        finished = len(chainer.stats.requests)
        taken = await chainer.fast_forward(until, chain=True)
        calls = chainer_kv.calls - calls
        for _ in range(taken):
            await plain.step()
        assert await snapshot(chainer, nothing) == await snapshot(plain, nothing)
        # requests finished at several step ends in one call: a chain
        if len({r.finish_s for r in chainer.stats.requests[finished:]}) > 1:
            chained += 1
            assert calls == 1
        return taken

    async def main() -> None:
        await drive_twins(requests, (chainer, plain), jump)
        assert await snapshot(chainer, nothing) == await snapshot(plain, nothing)

    anyio.run(main, backend="asyncio")
    event(f"chains: {min(chained, 3)}")


@st.composite
def bursts(draw: st.DrawFn) -> list[RequestSpec]:
    """A burst of requests at once, outputs of every length (they finish at different
    steps: a chain), then a few arrivals far enough apart for chains to run to them."""
    requests = []
    arrival = 0.0
    for i in range(draw(st.integers(2, 8))):
        if i >= 2 and draw(st.booleans()):
            arrival += draw(st.integers(8, 400)) * GRID
        prefix = draw(st.sampled_from(PREFIXES))
        own = Segment(mix_seed(50_000, i), draw(st.integers(0 if prefix else 1, 16)))
        output = Segment(mix_seed(90_000, i), draw(st.integers(1, 48)))
        requests.append(RequestSpec(f"r{i}", arrival, (*prefix, own), output))
    return requests


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.one_of(workloads(), bursts()),
    config=configs(),
    usage_free=st.booleans(),
)
def test_a_carried_chain_lands_with_the_next_step_as_if_sent_alone(
    requests: list[RequestSpec], config: EngineConfig, usage_free: bool
) -> None:
    """Twin engines (`drive_twins`), both with ``chain``: one carries its calls, the other
    does not. After each jump they keep the same state of their own, but for the active
    count, which a carried chain leaves an upper bound (its frees not counted); after
    each step (whose schedule lands a carried chain, the gate counted from that bound)
    and at the end they show the same manager, stats, report and records, and the
    carrier never made more KV calls."""
    if usage_free:  # what a chain needs, and carrying one prefix caching
        config = replace(config, enable_prefix_caching=True, timing=DYADIC)
    carrier, carrier_kv = counted_engine(config)
    plain, plain_kv = counted_engine(config)
    bounded = 0

    async def jump(until: float) -> int:
        nonlocal bounded
        taken = await carrier.fast_forward(until, carry=True, chain=True)
        assert await plain.fast_forward(until, chain=True) == taken
        mine, theirs = own_state(carrier), own_state(plain)
        assert mine[:3] + mine[4:] == theirs[:3] + theirs[4:]
        assert carrier.num_active_blocks >= plain.num_active_blocks
        bounded += carrier.num_active_blocks > plain.num_active_blocks  # frees uncounted
        return taken

    anyio.run(drive_carrier, requests, (carrier, carrier_kv), (plain, plain_kv), jump)
    event(f"chains carried with their frees uncounted: {min(bounded, 3)}")


@pytest.mark.parametrize("blocks", [7, 9, 20])
def test_a_chain_to_an_arrival_rides_on_its_admission(blocks: int) -> None:
    """ "a" finishes in a chain that runs on to "c"'s arrival: the chain's call rides on
    the step that admits "c" (one call for both), whose gate counts "a"'s blocks as
    held until the manager adds what its free released. In a pool where "c" fits only
    in those blocks it is admitted all the same, as stepping admits it."""
    config = EngineConfig(
        num_gpu_blocks=blocks, block_size=4, timing=STEP, enable_kv_cache_events=False
    )
    carrier, kv = counted_engine(config)
    plain, _ = counted_engine(config)
    nothing = EventCollector()
    requests = [one("a", 8, 4), one("b", 8, 12), one("c", 12, 3, arrival=2.0)]

    async def main() -> None:
        for engine in (carrier, plain):
            for spec in requests[:2]:
                await engine.submit(spec, 0.0)
            await engine.step()  # both prefill
        calls = kv.calls
        steps = await carrier.fast_forward(2.0, carry=True, chain=True)
        assert steps
        assert kv.calls == calls  # carried: no call of its own
        assert carrier.num_active_blocks > 0
        for _ in range(steps):
            await plain.step()
        for engine in (carrier, plain):
            await engine.submit(requests[2], 2.0)
        await carrier.step()  # its schedule carries the chain
        await plain.step()
        assert kv.calls == calls + 1
        assert await snapshot(carrier, nothing) == await snapshot(plain, nothing)
        assert any(request.request_id == "c" for request in carrier.running)
        while carrier.has_work:
            await carrier.step()
            await plain.step()
        assert await snapshot(carrier, nothing) == await snapshot(plain, nothing)

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize(("blocks", "jumps"), [(6, [4, 7]), (20, [11])])
def test_a_chain_its_bound_cuts_short_goes_on_with_the_next_call(
    blocks: int, jumps: list[int]
) -> None:
    """A chain plans the jumps after a finish from the active count before the frees (an
    upper bound until the manager answers). In a full pool "b"'s growth after "a"
    finishes does not fit under it: the chain ends there (after a step that fits) and
    the next call goes on with the true count. With room, one call runs to the end.
    Either way each call is one KV call, and stepping gives the same state."""
    config = EngineConfig(
        num_gpu_blocks=blocks, block_size=4, timing=STEP, enable_kv_cache_events=False
    )
    chainer, kv = counted_engine(config)
    plain, _ = counted_engine(config)
    nothing = EventCollector()

    async def main() -> None:
        for engine in (chainer, plain):
            await engine.submit(one("a", 8, 4), 0.0)
            await engine.submit(one("b", 8, 12), 0.0)
            await engine.step()  # both prefill
        taken = []
        while chainer.has_work:
            calls = kv.calls
            steps = await chainer.fast_forward(math.inf, chain=True)
            assert steps
            assert kv.calls - calls == 1
            taken.append(steps)
            for _ in range(steps):
                await plain.step()
            assert await snapshot(chainer, nothing) == await snapshot(plain, nothing)
        assert taken == jumps

    anyio.run(main, backend="asyncio")


# ------------------------------------------------------------------ targeted boundaries


def one(name: str, prompt: int, output: int, arrival: float = 0.0) -> RequestSpec:
    seed = mix_seed(*name.encode())
    return RequestSpec(name, arrival, (Segment(seed, prompt),), Segment(mix_seed(seed, 1), output))


@pytest.mark.parametrize(
    ("caching", "jumps"),
    [
        # positions 4..22 decoded: fills at 4, 8, ...; allocations at 5, 9, ...; 22 finishes
        (True, [2, 2, 2, 2]),
        # without caching a filled block is nobody's business: only allocations stop a jump
        (False, [1, 3, 3, 3, 3]),
    ],
)
def test_a_jump_that_may_not_cross_stops_before_a_block_boundary(
    caching: bool, jumps: list[int]
) -> None:
    """Without crossing (``cross_boundaries=False``, as when a waiting request may be
    admitted), a jump ends before the step that allocates a block or (caching) fills one."""
    config = EngineConfig(
        num_gpu_blocks=64, block_size=4, enable_prefix_caching=caching, timing=STEP
    )
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("a", 3, 20))
        assert not await twins.step(cross=False)  # the prefill
        while twins.jumper.has_work:
            if await twins.fast_forward(cross=False):
                request = twins.jumper.running[0]
                position = request.num_computed + 1  # the next step computes this token
                allocates = position > request.num_blocks * 4
                fills = caching and position % 4 == 0
                finishes = request.num_output + 1 == 20
                assert allocates or fills or finishes
            await twins.advance(cross=False)

    anyio.run(main, backend="asyncio")
    assert twins.jumps == jumps
    assert twins.jumper.stats.steps == 20
    assert twins.jumper.clock == 5.0


@pytest.mark.parametrize("caching", [True, False])
def test_a_jump_crosses_block_boundaries_in_one_call_when_nobody_waits(caching: bool) -> None:
    """With nobody waiting, one jump takes every decode step through the finish: the
    tables grow and (caching) the blocks fill in one `allocate_stretch` call, each step's
    events in a batch of its own, stamped with its end, as when stepping, and the
    finished request is freed in one `finish_step` call after it."""
    config = EngineConfig(
        num_gpu_blocks=64, block_size=4, enable_prefix_caching=caching, timing=STEP
    )
    twins = Twins(config)
    assert isinstance(twins.jumper.kv, LocalKvClient)
    counting = CountingSteps(twins.jumper.kv.manager)
    twins.jumper.kv = counting

    async def main() -> None:
        await twins.submit(one("a", 3, 20))
        assert not await twins.step()  # the prefill
        # positions 4..22: the last step samples a's last token, and a finishes
        assert await twins.fast_forward() == 19
        assert not twins.jumper.has_work
        await twins.run()

    anyio.run(main, backend="asyncio")
    assert twins.jumps == [19]
    assert twins.jumper.stats.steps == 20
    assert twins.jumper.clock == 5.0
    # the jump's one call: the steps computing positions 4 (a fill), 5 (a growth), 8, 9...
    grows = [[5, 9, 13, 17, 21]]
    fills = [[4, 8, 12, 16, 20]] if caching else [[]]
    [jump] = [call for call in counting.calls if len(call) > 1]
    assert [target for [target] in jump] == sorted(grows[0] + fills[0])
    if caching:  # five blocks stored, each in the batch of the step that filled it
        stored = [batch for batch in twins.sinks[0].batches if batch.events]
        assert [batch.ts for batch in stored] == [0.25 * (p - 2) for p in fills[0]]


def test_a_jump_ends_with_a_finish_when_nobody_waits() -> None:
    """With nobody waiting, a jump ends with the step in which a request samples its
    last token (it finishes then, as when stepping); the others run on."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP)
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("short", 3, 6))
        await twins.submit(one("long", 3, 30))
        await twins.step()  # both prefill
        assert await twins.fast_forward() == 5  # steps 2-6; "short" finishes in step 6
        assert [r.request_id for r in twins.jumper.running] == ["long"]
        assert [r.num_output for r in twins.jumper.running] == [6]
        assert twins.jumper.clock == 1.5
        await twins.run()

    anyio.run(main, backend="asyncio")
    assert twins.jumps == [5, 24]  # then steps 7-30 for "long" alone; it finishes in 30
    assert [r.finish_s for r in twins.jumper.stats.requests] == [1.5, 7.5]


def test_a_jump_stops_before_a_finish_while_a_request_waits() -> None:
    """With a request waiting (here held back by max_num_seqs), a jump ends before the
    step in which a request samples its last token: the step after it admits the
    waiting one."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP, max_num_seqs=2)
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("short", 3, 6))
        await twins.submit(one("long", 3, 30))
        await twins.step()  # both prefill
        await twins.submit(one("third", 7, 2))  # waits: two run already
        assert await twins.fast_forward() == 4  # steps 2-5; "short" finishes in step 6
        assert [r.num_output for r in twins.jumper.running] == [5, 5]
        assert twins.jumper.clock == 1.25
        await twins.run()

    anyio.run(main, backend="asyncio")
    records = {r.request_id: r for r in twins.jumper.stats.requests}
    assert records["short"].finish_s == 1.5
    assert records["third"].first_scheduled_s == 1.5  # in step 7, after short's finish


@pytest.mark.parametrize(
    ("arrival", "jump", "scheduled_at"),
    [
        (1.1, 4, 1.25),  # mid-step: steps starting at .25, .5, .75, 1.0; admitted at 1.25
        (1.0, 3, 1.0),  # at a step's end: the arrival goes first, admitted in that step
        (0.3, 1, 0.5),
    ],
)
def test_a_jump_stops_before_an_arrival(arrival: float, jump: int, scheduled_at: float) -> None:
    """A jump takes only steps starting before ``until``; the arrival is admitted in the
    same step as when stepping one at a time (in the engine and in a `Simulation`)."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP)
    late = one("late", 5, 3, arrival)
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("early", 3, 30))
        await twins.step()
        assert await twins.fast_forward(arrival) == jump
        assert twins.jumper.clock == 0.25 * (1 + jump)
        assert await twins.fast_forward(arrival) == 0
        await twins.submit(late)
        await twins.run()

    anyio.run(main, backend="asyncio")
    [record] = [r for r in twins.jumper.stats.requests if r.request_id == "late"]
    assert record.first_scheduled_s == scheduled_at
    for backend in sorted(KV_BACKENDS):
        requests = [one("early", 3, 30), late]
        fast = simulate(requests, config, fast_forward=True, backend=backend)
        slow = simulate(requests, config, fast_forward=False, backend=backend)
        assert_same_run(fast, slow)
        assert fast.step_calls < slow.step_calls
        [late_record] = [r for r in fast.records[0] if r["request_id"] == "late"]
        assert late_record["first_scheduled_s"] == scheduled_at


@pytest.mark.parametrize("caching", [True, False])
def test_a_waiting_request_refused_for_blocks_does_not_stop_a_jump(caching: bool) -> None:
    """A request that does not fit in the pool waits through the jumps and is admitted in
    the step after the running one finishes and frees its blocks."""
    config = EngineConfig(
        num_gpu_blocks=4, block_size=8, enable_prefix_caching=caching, timing=STEP
    )
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("a", 17, 14))  # 3 blocks after its prefill, 4 at the end
        await twins.submit(one("b", 10, 3))  # 2 blocks: never fits while "a" runs
        await twins.step()
        assert [r.request_id for r in twins.jumper.waiting] == ["b"]
        await twins.run()

    anyio.run(main, backend="asyncio")
    # "a" decodes positions 18..30: (caching) a fill at 24, an allocation at 25, which
    # the jump crosses ("b" needs more blocks than are left, whatever the cache holds:
    # its cost does not change); "a" finishes in step 14, stepped alone (b waits). "b"
    # is admitted in step 15 and jumps its two decode steps, the last finishing it.
    assert twins.jumps == [12, 2]
    records = {r.request_id: r for r in twins.jumper.stats.requests}
    assert records["a"].finish_s == 3.5
    assert records["b"].first_scheduled_s == 3.5


def test_a_jump_watching_the_head_ends_with_the_step_whose_fill_admits_it() -> None:
    """The head waits for blocks; a running request's block fills with tokens the head's
    prompt starts with, so its cost falls: the jump ends with that step, which admits
    the head after its allocations, as stepping does (and the head, with one token to
    sample, finishes in it)."""
    config = EngineConfig(num_gpu_blocks=3, block_size=4, timing=STEP)
    prompt, output = Segment(mix_seed(1), 4), Segment(mix_seed(2), 8)
    a = RequestSpec("a", 0.0, (prompt,), output)
    # a's prompt block, then a's first four output tokens, then one of its own: a cost
    # of 1 cached block (a's, in use) and 2 fresh, one more than the pool has left
    head = RequestSpec(
        "h",
        0.25,
        (prompt, Segment(output.seed, 4), Segment(mix_seed(3), 1)),
        Segment(mix_seed(4), 1),
    )
    twins = Twins(config)
    counting = CountingSteps(twins.jumper.kv.manager)  # type: ignore[attr-defined]
    twins.jumper.kv = counting

    async def main() -> None:
        await twins.submit(a)
        assert not await twins.step()  # the prefill
        await twins.submit(head)
        # steps 2-5 compute positions 5-8: 5 grows a's table (leaving 1 free block, so
        # h waits: step 2 asks its cost, h new to the manager, then jumps watching it),
        # 8 fills a's block [o0..o3], h's second block: h's cost falls to 1 fresh block,
        # which fits, and step 5 admits it
        assert await twins.step()
        assert await twins.fast_forward() == 3
        assert [r.request_id for r in twins.jumper.running] == ["a"]
        assert [r.request_id for r in twins.jumper.stats.requests] == ["h"]
        await twins.run()

    anyio.run(main, backend="asyncio")
    records = {r.request_id: r for r in twins.jumper.stats.requests}
    assert records["h"].first_scheduled_s == 1.0  # step 5 starts at 1.0
    assert records["h"].cached_tokens == 8
    # a's admission (no running slot), then step 2 grew a's table (position 5) and asked
    # h in one call; the jump's fill, in one call planned on to a's next growth
    # (position 9), which the manager did not try: it stopped after the step that
    # changed h's cost
    assert counting.calls[:3] == [[[]], [[5]], [[8], [9]]]


@pytest.mark.parametrize(
    ("limits", "jumps", "scheduled_at"),
    [
        # the budget: "b" needs 8 tokens in one step, 7 are left while "a" decodes
        ({"max_num_batched_tokens": 8, "enable_chunked_prefill": False}, [3], 1.25),
        ({"max_num_seqs": 1}, [3], 1.25),
    ],
    ids=["budget", "max_num_seqs"],
)
def test_the_waiting_head_is_admitted_as_soon_as_the_limits_allow(
    limits: dict[str, Any], jumps: list[int], scheduled_at: float
) -> None:
    """A request held back by the token budget or max_num_seqs is admitted in the first
    step after the running request finishes, jump or no jump."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP, **limits)
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("a", 4, 5))
        await twins.submit(one("b", 8, 1))
        await twins.run()

    anyio.run(main, backend="asyncio")
    assert twins.jumps == jumps
    records = {r.request_id: r for r in twins.jumper.stats.requests}
    assert records["a"].finish_s == 1.25
    assert records["b"].first_scheduled_s == scheduled_at


@pytest.mark.parametrize("caching", [True, False])
def test_an_abort_between_jumps_lets_the_waiting_head_in_at_once(caching: bool) -> None:
    """Blocks an abort frees admit the waiting head in the next step: no jump over it."""
    config = EngineConfig(
        num_gpu_blocks=2, block_size=64, enable_prefix_caching=caching, timing=STEP
    )
    twins = Twins(config)

    async def main() -> None:
        for name, output in (("a", 30), ("b", 30), ("c", 5)):
            await twins.submit(one(name, 10, output))
        await twins.step()  # "a" and "b" take the pool's two blocks; "c" waits
        assert await twins.fast_forward() == 28  # "c" does not stop the jump
        assert await twins.abort("a")
        assert await twins.fast_forward() == 0  # the next step admits "c"
        assert not await twins.step()
        assert [r.request_id for r in twins.jumper.running] == ["c"]  # "b" finished
        await twins.run()

    anyio.run(main, backend="asyncio")
    records = {r.request_id: r for r in twins.jumper.stats.requests}
    assert records["c"].first_scheduled_s == 7.25
    assert records["b"].finish_s == 7.5
    assert twins.jumper.stats.aborted == 1


def test_until_at_or_before_the_clock_takes_no_step() -> None:
    """``fast_forward(until)`` with ``until <= clock`` returns 0 and changes nothing; an
    ``until`` just past the clock takes the one step starting before it."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP)
    twins = Twins(config)

    async def main() -> None:
        await twins.submit(one("a", 3, 30))
        await twins.step()
        for until in (0.25, 0.1, 0.0, -math.inf):
            assert await twins.fast_forward(until) == 0
        assert twins.jumper.clock == 0.25
        assert await twins.fast_forward(math.nextafter(0.25, math.inf)) == 1
        assert twins.jumper.clock == 0.5

    anyio.run(main, backend="asyncio")


def test_an_idle_engine_takes_no_step() -> None:
    """An engine with nothing to do returns 0 and keeps its clock, before and after work."""
    config = EngineConfig(num_gpu_blocks=8, block_size=64, timing=STEP)
    twins = Twins(config)

    async def main() -> None:
        for until in (math.inf, 10.0):
            assert await twins.fast_forward(until) == 0
        assert twins.jumper.clock == 0.0
        await twins.submit(one("a", 3, 5, arrival=2.0))
        await twins.run()
        assert twins.jumper.clock == 3.25
        assert await twins.fast_forward() == 0
        assert await twins.fast_forward(100.0) == 0
        assert twins.jumper.clock == 3.25

    anyio.run(main, backend="asyncio")
    assert twins.jumper.stats.steps == 5


@pytest.mark.parametrize("timing", sorted(TIMINGS))
@pytest.mark.parametrize("preemption_mode", ["lifo", "fifo"])
def test_jumps_and_steps_equal_stepping_one_at_a_time(
    timing: str, preemption_mode: PreemptionMode
) -> None:
    """Fast-forward then step, to the end, on a pool tight enough to preempt and evict:
    the same requests' state, stats, records and batches as stepping each step."""
    config = EngineConfig(
        num_gpu_blocks=24,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        preemption_mode=preemption_mode,
        timing=TIMINGS[timing],
    )
    twins = Twins(config)
    shared = Segment(31337, 9)

    async def main() -> None:
        for i in range(6):
            prompt = (shared, Segment(mix_seed(8, i), 3 + i)) if i % 2 else (shared,)
            await twins.submit(RequestSpec(f"q{i}", 0.0, prompt, Segment(mix_seed(9, i), 30)))
        await twins.run()

    anyio.run(main, backend="asyncio")
    stats = twins.jumper.stats
    assert stats.completed == 6
    assert stats.preemptions > 0
    assert stats.prefix_hit_tokens > 0
    assert twins.jumps


# ------------------------------------------------------------------ the CLI


def cli_run(tmp_path: Path, name: str, flags: Sequence[str]) -> tuple[dict[str, Any], bytes]:
    """``kvpool simulate FLAGS`` in-process: the JSON report (less wall time and
    settings) and the ``--requests-jsonl`` bytes."""
    report_path = tmp_path / f"{name}.json"
    records_path = tmp_path / f"{name}.jsonl"
    args = ["simulate", "--no-progress", "--loop", "asyncio", "--sessions", "16", *flags]
    args += ["--json", str(report_path), "--requests-jsonl", str(records_path)]
    assert cli.main(args) == 0
    report: dict[str, Any] = json.loads(report_path.read_bytes())
    for key in ("wall_s", "requests_per_wall_s", "settings"):
        del report[key]
    return report, records_path.read_bytes()


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param([], id="defaults"),
        pytest.param(
            [
                "--workers",
                "2",
                "--num-gpu-blocks",
                "160",
                "--preemption-mode",
                "fifo",
                "--timing-model",
                "dynamo",
                "--kv-backend",
                "local",
                "--dispatch",
                "round-robin",
            ],
            id="fifo-dynamo-2-workers",
        ),
    ],
)
def test_the_cli_reports_the_same_run_with_and_without_fast_forward(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvpool simulate`` (fast-forward by default) and ``--no-fast-forward``: the same
    JSON report but for wall time and settings, byte-identical request records."""
    default = cli_run(tmp_path, "default", flags)
    explicit = cli_run(tmp_path, "on", [*flags, "--fast-forward"])
    stepped = cli_run(tmp_path, "off", [*flags, "--no-fast-forward"])
    assert default == explicit
    assert default[0] == stepped[0]
    assert default[1] == stepped[1]
    assert default[0]["total"]["requests_completed"] > 0
    capsys.readouterr()
