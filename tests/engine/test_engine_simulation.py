"""Several engines in simulated time: clocks, dispatch, pacing, reports, KV backends."""

from __future__ import annotations

from array import array
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.engine import (
    Dispatch,
    EngineConfig,
    EngineStats,
    LocalKvClient,
    MockEngine,
    Simulation,
    TimingModel,
    format_report,
)
from kvpool.engine.report import Distribution, worker_report
from kvpool.engine.runner import open_local_kv, run_simulation
from kvpool.errors import InvalidArgumentError
from kvpool.events import EventCollector
from kvpool.manager import PoolUsage
from kvpool.workloads import RequestSpec, Segment, SyntheticWorkload, mix_seed

pytestmark = pytest.mark.anyio

CONFIG = EngineConfig(num_gpu_blocks=256, max_num_batched_tokens=1024)


def spec(name: str, prompt: int, output: int, arrival: float) -> RequestSpec:
    seed = mix_seed(*name.encode())
    return RequestSpec(name, arrival, (Segment(seed, prompt),), Segment(seed + 1, output))


def engines(count: int, config: EngineConfig = CONFIG) -> list[MockEngine]:
    return [
        MockEngine(LocalKvClient.create(config.num_gpu_blocks, config.block_size), config, rank=r)
        for r in range(count)
    ]


async def test_an_idle_engine_jumps_to_the_next_arrival() -> None:
    timing = TimingModel(step_overhead_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    [engine] = engines(1, config)
    requests = [spec("early", 10, 3, 0.0), spec("late", 10, 3, 100.0)]
    await Simulation([engine], requests).run()
    # each request: 3 steps of 10 ms; the engine idles from 0.03 s to 100 s
    assert engine.clock == pytest.approx(100.03)
    assert engine.stats.ttft_s == pytest.approx([0.01, 0.01])
    assert engine.stats.latency_s == pytest.approx([0.03, 0.03])
    assert engine.stats.busy_s == pytest.approx(0.06)


async def test_a_request_arriving_mid_step_counts_from_its_arrival() -> None:
    timing = TimingModel(step_overhead_s=1.0, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    [engine] = engines(1, config)
    requests = [spec("first", 10, 5, 0.0), spec("second", 10, 1, 2.5)]
    await Simulation([engine], requests).run()
    # "second" arrives during the step from 2 s to 3 s and is first scheduled at 3 s
    assert engine.stats.ttft_s == pytest.approx([1.0, 1.5])


async def test_round_robin_alternates_workers() -> None:
    workers = engines(3)
    requests = [spec(f"r{i}", 20, 2, 0.0) for i in range(7)]
    await Simulation(workers, requests, dispatch="round-robin").run()
    assert [w.stats.submitted for w in workers] == [3, 2, 2]


async def test_least_loaded_fills_the_emptier_worker() -> None:
    workers = engines(2)
    # a long request lands on worker 0; the next three find worker 1 emptier or tied
    requests = [spec("long", 20, 3000, 0.0)] + [spec(f"s{i}", 20, 2, 1.0 + i) for i in range(3)]
    await Simulation(workers, requests, dispatch="least-loaded").run()
    assert workers[0].stats.rejected == 0
    assert [w.stats.submitted for w in workers] == [1, 3]


async def test_each_worker_has_its_own_pool_and_event_stream() -> None:
    sinks = [EventCollector(), EventCollector()]
    workers = [
        MockEngine(LocalKvClient.create(256, 16), CONFIG, rank=rank, sink=sinks[rank])
        for rank in range(2)
    ]
    requests = SyntheticWorkload(seed=1, num_sessions=10).requests()
    await Simulation(workers, requests, dispatch="round-robin").run()
    for rank, (worker, sink) in enumerate(zip(workers, sinks, strict=True)):
        assert sink.batches
        assert {b.data_parallel_rank for b in sink.batches} == {rank}
        assert worker.stats.event_batches == len(sink.batches)
    assert workers[0].kv is not workers[1].kv


async def test_pacing_changes_nothing_but_the_wall_clock() -> None:
    requests = SyntheticWorkload(seed=2, num_sessions=3).requests()
    fast = engines(1)
    await Simulation(fast, requests).run()
    paced = engines(1)
    await Simulation(paced, requests, speedup_ratio=10_000.0).run()
    assert paced[0].clock == fast[0].clock
    assert paced[0].stats.usage == fast[0].stats.usage
    assert paced[0].stats.ttft_s == fast[0].stats.ttft_s


async def test_progress_is_reported_until_every_request_settles() -> None:
    seen: list[tuple[int, int, float]] = []
    requests = SyntheticWorkload(seed=3, num_sessions=6).requests()
    await Simulation(engines(2), requests, on_progress=lambda *a: seen.append(a)).run()
    done = [d for d, _, _ in seen]
    assert done == sorted(done)
    assert seen[-1][:2] == (len(requests), len(requests))
    times = [t for _, _, t in seen]
    assert times[-1] == max(times)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dispatch": "random"}, "dispatch"),
        ({"speedup_ratio": -1.0}, "speedup_ratio"),
    ],
)
async def test_bad_simulation_arguments_are_refused(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Simulation(engines(1), [], **kwargs)  # type: ignore[arg-type]


async def test_requests_must_be_ordered_and_engines_present() -> None:
    with pytest.raises(InvalidArgumentError, match="ordered"):
        Simulation(engines(1), [spec("b", 5, 1, 2.0), spec("a", 5, 1, 1.0)])
    with pytest.raises(InvalidArgumentError, match="at least one engine"):
        Simulation([], [])


async def test_run_simulation_reports_per_worker_and_in_total() -> None:
    requests = SyntheticWorkload(seed=4, num_sessions=12).requests()
    config = EngineConfig(num_gpu_blocks=160, max_num_batched_tokens=512)
    run = await run_simulation(requests, config, workers=2, workload="test")
    report = run.report
    total = report.total
    assert total.requests_submitted == len(requests)
    assert total.requests_completed + total.requests_rejected == len(requests)
    assert total.leaked_blocks == 0
    assert total.num_gpu_blocks == 2 * 160
    assert [w.worker for w in report.workers] == [0, 1]
    assert total.preemptions == sum(w.preemptions for w in report.workers)
    assert total.prefix_cache_hits <= total.prefix_cache_queries
    assert report.simulated_s == max(w.simulated_s for w in report.workers)
    text = format_report(report)
    assert "worker 1" in text
    assert "prefix cache hit rate" in text


async def test_one_workers_total_is_its_stats_pooled_as_for_many() -> None:
    """With one engine the report reuses the worker's figures as the total: they are what
    pooling its stats would give (the long way, as for several workers)."""
    requests = SyntheticWorkload(seed=6, num_sessions=10).requests()
    run = await run_simulation(requests, CONFIG, workers=1, kv_factory=open_local_kv)
    [engine] = run.engines
    final = [await engine.final_usage()]
    pooled = worker_report(None, [engine.stats], engine.clock, final)
    assert pooled.kv_usage.mean > 0  # samples to pool: the check has something to compare
    assert run.report.total == pooled
    assert run.report.workers[0].worker == 0


async def test_the_same_workload_gives_the_same_report() -> None:
    requests = SyntheticWorkload(seed=5, num_sessions=10).requests()
    first = await run_simulation(requests, CONFIG, workers=2, kv_factory=open_local_kv)
    second = await run_simulation(requests, CONFIG, workers=2, kv_factory=open_local_kv)
    assert first.report.total == second.report.total
    assert first.report.workers == second.report.workers


async def test_without_prefix_caching_the_hit_rate_reads_n_a_not_0() -> None:
    requests = SyntheticWorkload(seed=4, num_sessions=3).requests()
    config = EngineConfig(num_gpu_blocks=160, enable_prefix_caching=False)
    report = (await run_simulation(requests, config)).report
    assert report.total.prefix_cache_queries == 0
    assert report.total.prefix_cache_hit_rate is None
    [row] = [line for line in format_report(report).splitlines() if "hit rate" in line]
    assert row.split()[-1] == "n/a"
    cached = (await run_simulation(requests, EngineConfig(num_gpu_blocks=160))).report
    assert cached.total.prefix_cache_hit_rate == pytest.approx(
        cached.total.prefix_cache_hits / cached.total.prefix_cache_queries
    )


async def test_kv_usage_is_weighted_by_simulated_time_idle_stretches_included() -> None:
    timing = TimingModel(step_overhead_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    requests = [spec("early", 10, 3, 0.0), spec("late", 10, 3, 100.0)]
    run = await run_simulation(requests, config)
    # each request holds 1 of 64 blocks for two 10 ms steps, then frees it; in between
    # the cache sits idle at 0 for almost 100 s. A step that leaves the usage as it was
    # stores no sample: [1/64, (1/64), 0] per request, 0.04% of the time at 1/64
    assert list(run.engines[0].stats.usage) == pytest.approx([1 / 64, 0.0] * 2)
    usage = run.report.total.kv_usage
    assert usage.max == pytest.approx(1 / 64)
    assert usage.p50 == usage.p99 == 0.0
    assert usage.mean == pytest.approx(0.04 / 100.02 / 64)


def test_a_worker_that_finished_early_is_idle_until_the_end_of_the_run() -> None:
    stats = EngineStats(sample_times=array("d", [1.0, 2.0]), usage=array("d", [0.5, 0.0]))
    final = [PoolUsage(0, 0, 64)]
    alone = worker_report(0, [stats], 2.0, final)
    assert alone.kv_usage.mean == pytest.approx(0.5)  # 0.5 from 1 s to 2 s, then the end
    in_a_longer_run = worker_report(0, [stats], 2.0, final, end=11.0)
    assert in_a_longer_run.kv_usage.mean == pytest.approx(0.05)  # then idle until 11 s
    assert in_a_longer_run.kv_usage.p50 == 0.0
    assert in_a_longer_run.kv_usage.max == 0.5


# ------------------------------------------------------------ latency figures, records


async def test_latencies_are_vllm_bench_serves_hand_computed() -> None:
    # 10 ms per step, nothing else: a request computes its prompt in one step, then
    # one token per step. "a" (3 tokens) arrives at 0, "b" (1 token) mid-way through
    # a's first step, "c" (4 tokens) after both have finished.
    timing = TimingModel(step_overhead_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    requests = [spec("a", 10, 3, 0.0), spec("b", 10, 1, 0.005), spec("c", 10, 4, 1.0)]
    run = await run_simulation(requests, config)
    total = run.report.total
    # a: tokens at 0.01, 0.02, 0.03; b: scheduled at 0.01, token at 0.02;
    # c: tokens at 1.01, 1.02, 1.03, 1.04
    assert total.ttft_s.mean == pytest.approx((0.01 + 0.015 + 0.01) / 3)
    assert total.ttft_s.max == pytest.approx(0.015)
    assert total.itl_s.mean == pytest.approx(0.01)  # 2 gaps of a, 3 of c, none of b
    assert total.itl_s.p99 == pytest.approx(0.01)
    assert total.tpot_s.mean == pytest.approx(0.01)  # a and c; b has one token: no TPOT
    assert total.latency_s.max == pytest.approx(0.04)
    assert total.latency_s.p50 == pytest.approx(0.03)
    assert total.output_tokens_per_s == pytest.approx(8 / 1.04)
    stats = run.engines[0].stats
    assert sum(stats.itl_counts.values()) == 5
    assert len(stats.tpot_s) == 2
    records = {r.request_id: r for r in stats.requests}
    b = records["b"]
    assert (b.arrival_s, b.first_scheduled_s) == (0.005, pytest.approx(0.01))
    assert (b.first_token_s, b.finish_s) == (pytest.approx(0.02), pytest.approx(0.02))
    assert (b.prompt_tokens, b.output_tokens, b.preemptions, b.worker) == (10, 1, 0, 0)
    assert not b.rejected
    c = records["c"]
    assert c.first_scheduled_s == pytest.approx(1.0)
    assert c.finish_s == pytest.approx(1.04)


async def test_tpot_and_itl_weigh_differently_as_vllm_defines_them() -> None:
    # a request's TPOT is the mean of its gaps; ITL pools every gap of every request:
    # one slow request of 2 gaps and one fast of 20 give TPOT mean (slow+fast)/2
    timing = TimingModel(step_overhead_s=0.01, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    slow_timing = TimingModel(step_overhead_s=0.05, prefill_token_s=0.0, decode_seq_s=0.0)
    fast = await run_simulation([spec("f", 10, 21, 0.0)], config)
    slow = await run_simulation(
        [spec("s", 10, 3, 0.0)], EngineConfig(num_gpu_blocks=64, timing=slow_timing)
    )
    stats = EngineStats(
        tpot_s=fast.engines[0].stats.tpot_s + slow.engines[0].stats.tpot_s,
        itl_counts=Counter(fast.engines[0].stats.itl_counts)
        + Counter(slow.engines[0].stats.itl_counts),
    )
    report = worker_report(None, [stats], 1.0, [PoolUsage(0, 0, 64)])
    assert report.tpot_s.mean == pytest.approx((0.01 + 0.05) / 2)
    assert report.itl_s.mean == pytest.approx((20 * 0.01 + 2 * 0.05) / 22)


async def test_records_cover_every_request_and_add_up_to_the_report() -> None:
    requests = SyntheticWorkload(seed=4, num_sessions=12).requests()
    config = EngineConfig(num_gpu_blocks=120, max_num_batched_tokens=512)
    run = await run_simulation(requests, config, workers=2)
    assert run.report.total.preemptions > 0  # re-admissions happen
    assert run.report.total.requests_rejected > 0
    seen: list[str] = []
    for engine, worker in zip(run.engines, run.report.workers, strict=True):
        records = engine.stats.requests
        seen += [r.request_id for r in records]
        assert {r.worker for r in records} <= {engine.rank}
        # cached tokens are summed over admissions: they add up to the worker's hits
        assert sum(r.cached_tokens for r in records) == worker.prefix_cache_hits
        assert sum(r.preemptions for r in records) == worker.preemptions
        assert sum(r.rejected for r in records) == worker.requests_rejected
        for r in records:
            if r.rejected:
                assert r.first_scheduled_s is r.first_token_s is r.finish_s is None
                continue
            assert r.first_scheduled_s is not None
            assert r.first_token_s is not None
            assert r.finish_s is not None
            assert r.arrival_s <= r.first_scheduled_s < r.first_token_s <= r.finish_s
    assert sorted(seen) == sorted(r.request_id for r in requests)


# ------------------------------------------------------------ streaming, the engine heap


async def test_requests_may_be_a_one_shot_iterator() -> None:
    requests = SyntheticWorkload(seed=6, num_sessions=5).requests()
    seen: list[tuple[int, int, float]] = []
    listed = engines(2)
    await Simulation(listed, requests).run()
    streamed = engines(2)
    await Simulation(streamed, iter(requests), on_progress=lambda *a: seen.append(a)).run()
    assert [e.stats.usage for e in streamed] == [e.stats.usage for e in listed]
    assert [e.clock for e in streamed] == [e.clock for e in listed]
    assert seen[-1][:2] == (len(requests), 0)  # no length: the total reads 0


async def test_an_iterator_out_of_order_is_refused_when_it_comes_up() -> None:
    requests = iter([spec("a", 5, 1, 2.0), spec("b", 5, 1, 1.0)])
    with pytest.raises(InvalidArgumentError, match=r"b arrives at 1\.0s, after one at 2\.0s"):
        await Simulation(engines(1), requests).run()


class CountingEngine(MockEngine):
    """A MockEngine that counts how often the simulation asks for its work and load."""

    reads = 0

    @property
    def has_work(self) -> bool:
        CountingEngine.reads += 1
        return bool(self.running or self.waiting)

    @property
    def num_outstanding(self) -> int:
        CountingEngine.reads += 1
        return len(self.running) + len(self.waiting)


@pytest.mark.parametrize("dispatch", ["round-robin", "least-loaded"])
@pytest.mark.parametrize("workers", [10, 1000])
async def test_choosing_the_next_engine_does_not_scan_the_workers(
    workers: int, dispatch: Dispatch
) -> None:
    pool = [
        CountingEngine(LocalKvClient.create(16, 16), EngineConfig(num_gpu_blocks=16), rank=r)
        for r in range(workers)
    ]
    requests = [spec(f"r{i}", 20, 5, 0.01 * i) for i in range(6)]
    CountingEngine.reads = 0
    await Simulation(pool, requests, dispatch=dispatch).run()
    steps = sum(e.stats.steps for e in pool)
    assert steps == 6 * 5
    # one read per worker to build each heap, then a bounded number per step and
    # arrival (engine.step and advance_to ask too) - none that grows with the workers
    per_step = (CountingEngine.reads - 2 * workers) / steps
    assert per_step <= 6


class LoadCheckingEngine(MockEngine):
    """A MockEngine that checks, on every submit, that it is the least loaded."""

    cluster: ClassVar[list[LoadCheckingEngine]] = []

    async def submit(self, spec: RequestSpec, arrival_s: float | None = None) -> bool:
        loads = [(e.num_outstanding, e.rank) for e in LoadCheckingEngine.cluster]
        assert min(loads) == (self.num_outstanding, self.rank)
        return await super().submit(spec, arrival_s)


async def test_least_loaded_dispatch_picks_the_fewest_outstanding_lowest_rank() -> None:
    config = EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256, max_num_seqs=4)
    LoadCheckingEngine.cluster = [
        LoadCheckingEngine(LocalKvClient.create(64, 16), config, rank=r) for r in range(5)
    ]
    # 1,000 requests, bursts and lulls: loads rise, fall and tie; the heap of loads is
    # rebuilt several times over
    requests = SyntheticWorkload(seed=7, num_sessions=300).requests()[:1000]
    await Simulation(LoadCheckingEngine.cluster, requests, dispatch="least-loaded").run()
    assert sum(e.stats.submitted for e in LoadCheckingEngine.cluster) == 1000
    assert all(e.stats.submitted > 0 for e in LoadCheckingEngine.cluster)  # all had a turn


@given(
    st.dictionaries(
        st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_subnormal=False),
        st.integers(min_value=1, max_value=40),
        max_size=12,
    )
)
def test_a_counted_distribution_is_exactly_that_of_its_expanded_values(
    counts: dict[float, int],
) -> None:
    """ITL samples are kept as value -> count; their summary must be bit for bit the
    summary of the values one by one (mean, interpolated percentiles, max)."""
    expanded = [value for value, count in counts.items() for _ in range(count)]
    assert Distribution.of_counts(counts) == Distribution.of(expanded)
