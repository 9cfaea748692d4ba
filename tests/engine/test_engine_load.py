"""Dynamo replay's workloads, hand-computed: closed loop, arrival speedup, max-model-len,
a stopped clock, multi-turn sessions, goodput and data-parallel ranks in lockstep.

Every step of `STEP` lasts exactly 0.25 s (no per-token cost), so a request of ``k``
output tokens alone on an engine has its first token 0.25 s after it is scheduled and
its last 0.25 * k s after; times are exact binary fractions."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvpool.engine import EngineConfig, LocalKvClient, MockEngine, Simulation, TimingModel
from kvpool.engine.goodput import Sla
from kvpool.engine.report import Report
from kvpool.engine.runner import run_simulation
from kvpool.errors import InvalidArgumentError
from kvpool.workloads import RequestSpec, Segment, mix_seed
from kvpool.workloads.session import Session

pytestmark = pytest.mark.anyio

STEP = TimingModel(step_overhead_s=0.25, prefill_token_s=0.0, decode_seq_s=0.0)
CONFIG = EngineConfig(num_gpu_blocks=64, timing=STEP)


def spec(name: str, prompt: int, output: int, arrival: float = 0.0) -> RequestSpec:
    seed = mix_seed(*name.encode())
    return RequestSpec(name, arrival, (Segment(seed, prompt),), Segment(seed + 1, output))


async def run(
    requests: Iterable[RequestSpec | Session], config: EngineConfig = CONFIG, **kwargs: object
) -> tuple[Report, dict[str, tuple[float, float | None, float | None]]]:
    """The report and each settled request's (arrival, first token, finish)."""
    done = await run_simulation(requests, config, **kwargs)  # type: ignore[arg-type]
    records = {
        r.request_id: (r.arrival_s, r.first_token_s, r.finish_s)
        for engine in done.engines
        for r in engine.stats.requests
    }
    return done.report, records


async def test_closed_loop_sends_the_next_request_as_one_finishes() -> None:
    # timestamps only order the workload: the 10 ms and 50 s gaps vanish
    requests = [spec("a", 10, 2, 0.0), spec("b", 10, 2, 0.01), spec("c", 10, 2, 50.0)]
    report, records = await run(requests, concurrency=1)
    assert records == {
        "a": (0.0, 0.25, 0.5),
        "b": (0.5, 0.75, 1.0),
        "c": (1.0, 1.25, 1.5),
    }
    assert report.simulated_s == 1.5


async def test_closed_loop_keeps_n_in_flight_and_a_rejection_frees_its_slot() -> None:
    config = EngineConfig(num_gpu_blocks=64, timing=STEP, max_model_len=20)
    requests = [
        spec("a", 10, 2),
        spec("too-long", 30, 2),  # rejected on arrival at 0: "c" takes its slot at once
        spec("c", 10, 4),
        spec("d", 10, 2),  # waits for "a", which finishes first
    ]
    report, records = await run(requests, config, concurrency=2)
    assert records["a"] == (0.0, 0.25, 0.5)
    assert records["too-long"] == (0.0, None, None)
    assert records["c"] == (0.0, 0.25, 1.0)
    assert records["d"] == (0.5, 0.75, 1.0)
    assert report.total.requests_rejected == 1
    assert report.total.requests_completed == 3


async def test_arrival_speedup_ratio_divides_the_timestamps() -> None:
    requests = [spec("a", 10, 2, 0.0), spec("b", 10, 2, 10.0)]
    report, records = await run(requests, arrival_speedup_ratio=4.0)
    assert records == {"a": (0.0, 0.25, 0.5), "b": (2.5, 2.75, 3.0)}
    assert report.simulated_s == 3.0


async def test_max_model_len_rejects_a_longer_request_and_admits_one_that_fits() -> None:
    requests = [spec("fits", 10, 2, 0.0), spec("over", 10, 3, 0.0)]
    report, records = await run(requests, EngineConfig(timing=STEP, max_model_len=12))
    assert records["fits"] == (0.0, 0.25, 0.5)
    assert records["over"] == (0.0, None, None)
    assert (report.total.requests_completed, report.total.requests_rejected) == (1, 1)
    with pytest.raises(InvalidArgumentError):
        EngineConfig(max_model_len=0)


async def test_max_sim_time_stops_the_clock_and_reports_what_it_cut() -> None:
    requests = [spec("a", 10, 4, 0.0), spec("b", 10, 4, 0.5), spec("c", 10, 2, 5.0)]
    # "a" finishes at 1.0; the step started at 1.0 (< 1.1) ends at 1.25, no later one
    # starts; "b" is in flight then, "c" would arrive at 5 s
    report, records = await run(requests, max_sim_time_s=1.1)
    assert records == {"a": (0.0, 0.25, 1.0)}
    assert report.simulated_s == 1.25
    assert (report.requests_unfinished, report.requests_unstarted) == (1, 1)
    assert report.max_sim_time_s == 1.1
    assert report.total.leaked_blocks == 0  # the unfinished request's blocks were freed
    assert report.total.requests_completed == 1


async def test_max_sim_time_in_closed_loop_counts_requests_never_given_a_slot() -> None:
    requests = [spec(name, 10, 2) for name in "abcd"]
    report, records = await run(requests, concurrency=1, max_sim_time_s=0.6)
    assert records == {"a": (0.0, 0.25, 0.5)}
    assert (report.requests_unfinished, report.requests_unstarted) == (1, 2)


async def test_a_session_sends_its_next_turn_a_delay_after_the_last_finished() -> None:
    sessions = [
        Session(spec("s0-t0", 10, 2, 0.0), (spec("s0-t1", 10, 2), spec("s0-t2", 10, 1)), 0.125),
        Session(spec("s1-t0", 10, 1, 3.0)),
    ]
    report, records = await run(sessions)
    assert records == {
        "s0-t0": (0.0, 0.25, 0.5),
        "s0-t1": (0.625, 0.875, 1.125),
        "s0-t2": (1.25, 1.5, 1.5),
        "s1-t0": (3.0, 3.25, 3.25),
    }
    assert report.total.requests_completed == 4


async def test_closed_loop_holds_a_slot_for_a_whole_session() -> None:
    sessions = [
        Session(spec("s0-t0", 10, 2), (spec("s0-t1", 10, 2),), 0.25),
        Session(spec("s1-t0", 10, 2)),
    ]
    _, records = await run(sessions, concurrency=1)
    assert records["s0-t1"] == (0.75, 1.0, 1.25)
    assert records["s1-t0"] == (1.25, 1.5, 1.75)  # sent when the session's last turn ends


async def test_a_session_cut_by_max_sim_time_counts_its_unsent_turns() -> None:
    sessions = [Session(spec("t0", 10, 2), (spec("t1", 10, 2), spec("t2", 10, 2)), 1.0)]
    report, _ = await run(sessions, max_sim_time_s=1.0)
    # t0 ends at 0.5; t1 is due at 1.5, past the stop: t1 and t2 never sent
    assert (report.requests_unfinished, report.requests_unstarted) == (0, 2)


async def test_goodput_counts_the_requests_that_met_every_target_bounds_included() -> None:
    config = EngineConfig(num_gpu_blocks=64, max_num_seqs=1, timing=STEP)
    # "a": TTFT 0.25, ITL 0.25, E2E 0.5; "b" waits for "a": TTFT 0.75, ITL 0.25, E2E 1.0
    requests = [spec("a", 10, 2), spec("b", 10, 2)]
    for sla, good in [
        (Sla(ttft_ms=250.0), 1),
        (Sla(ttft_ms=749.0), 1),
        (Sla(ttft_ms=750.0), 2),
        (Sla(itl_ms=250.0), 2),
        (Sla(itl_ms=249.0), 0),
        (Sla(e2e_ms=500.0), 1),
        (Sla(ttft_ms=1000.0, e2e_ms=500.0), 1),
    ]:
        report, _ = await run(requests, config, sla=sla)
        goodput = report.total.goodput
        assert goodput is not None
        assert goodput.goodput_completed_requests == good, sla
        assert goodput.goodput_request_throughput_rps == good / 1.0  # the run lasts 1 s
        assert goodput.goodput_output_throughput_tok_s == 2 * good / 1.0
    report, _ = await run(requests, config)
    assert report.total.goodput is None
    assert report.sla is None


async def test_a_one_token_request_meets_any_itl_target() -> None:
    report, _ = await run([spec("one", 10, 1)], sla=Sla(itl_ms=0.001))
    assert report.total.goodput is not None
    assert report.total.goodput.goodput_completed_requests == 1


def test_an_sla_needs_a_positive_target() -> None:
    for kwargs in ({}, {"ttft_ms": 0.0}, {"itl_ms": -1.0}, {"e2e_ms": float("inf")}):
        with pytest.raises(InvalidArgumentError):
            Sla(**kwargs)  # type: ignore[arg-type]


async def test_lockstep_ranks_step_as_long_as_the_slowest() -> None:
    # prefill costs 2**-10 s per token: a 256-token prompt's step lasts 0.5 s, a
    # 16-token one's 0.265625 s; a decode step 0.25 s
    timing = TimingModel(step_overhead_s=0.25, prefill_token_s=2**-10, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=64, timing=timing)
    requests = [spec("long", 256, 2), spec("short", 16, 2)]
    common = {"workers": 2, "dispatch": "round-robin"}
    _, alone = await run(requests, config, **common)
    assert alone["short"] == (0.0, 0.265625, 0.515625)
    assert alone["long"] == (0.0, 0.5, 0.75)
    _, locked = await run(requests, config, lockstep=True, **common)
    assert locked["short"] == (0.0, 0.5, 0.75)
    assert locked["long"] == (0.0, 0.5, 0.75)


async def test_lockstep_an_idle_rank_starts_a_request_at_the_steps_end() -> None:
    requests = [spec("busy", 10, 3, 0.0), spec("late", 10, 1, 0.125)]
    common = {"workers": 2, "dispatch": "round-robin"}
    _, alone = await run(requests, **common)
    assert alone["late"] == (0.125, 0.375, 0.375)
    report, locked = await run(requests, lockstep=True, **common)
    assert locked["late"] == (0.125, 0.5, 0.5)  # rank 1 ran a dummy step until 0.25
    assert locked["busy"] == (0.0, 0.25, 0.75)
    assert [w.simulated_s for w in report.workers] == [0.75, 0.75]  # one clock


async def test_lockstep_with_closed_loop_and_a_stop() -> None:
    requests = [spec(name, 10, 2) for name in "abcd"]
    report, records = await run(
        requests, workers=2, lockstep=True, concurrency=2, max_sim_time_s=0.75
    )
    assert records == {"a": (0.0, 0.25, 0.5), "b": (0.0, 0.25, 0.5)}
    assert (report.requests_unfinished, report.requests_unstarted) == (2, 0)


def test_bad_load_arguments_are_refused() -> None:
    for kwargs in (
        {"concurrency": 0},
        {"arrival_speedup_ratio": 0.0},
        {"arrival_speedup_ratio": float("inf")},
        {"max_sim_time_s": 0.0},
    ):
        kv = LocalKvClient.create(CONFIG.num_gpu_blocks, CONFIG.block_size)
        with pytest.raises(InvalidArgumentError):
            Simulation([MockEngine(kv, CONFIG)], [], **kwargs)  # type: ignore[arg-type]


async def test_closed_loop_ignores_the_order_check() -> None:
    # closed loop reads no timestamp, so a workload out of timestamp order runs in order
    requests = [spec("late", 10, 1, 9.0), spec("early", 10, 1, 1.0)]
    _, records = await run(requests, concurrency=1)
    assert records == {"late": (0.0, 0.25, 0.25), "early": (0.25, 0.5, 0.5)}


def pressured() -> EngineConfig:
    # small pool and batch: preemptions, evictions, queueing; the default linear timing
    return EngineConfig(num_gpu_blocks=96, max_num_seqs=6, max_num_batched_tokens=256)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize(
    ("workload", "kwargs"),
    [
        ("sessions", {}),
        ("sessions", {"concurrency": 4}),
        ("trace", {"concurrency": 5}),
        ("roomy", {"concurrency": 4}),
        ("roomy", {"concurrency": 7}),
        ("trace", {"concurrency": 2, "max_sim_time_s": 0.4}),
        ("sessions", {"max_sim_time_s": 0.7}),
    ],
)
async def test_fast_forward_is_exact_when_completions_release_requests(
    workers: int, workload: str, kwargs: dict[str, object]
) -> None:
    """A jump may not pass a moment at which another engine's completion releases a
    request: fast-forward and single steps give the same records, step for step."""
    from kvpool.workloads import SyntheticSessions, SyntheticWorkload

    if workload == "sessions":
        requests: list[RequestSpec | Session] = list(
            SyntheticSessions(
                120,
                24,
                12,
                request_rate=40.0,
                turns_per_session=3,
                inter_turn_delay_s=0.01,
                shared_prefix_ratio=0.5,
                num_prefix_groups=2,
                seed=5,
            ).sessions()
        )
    else:
        requests = list(SyntheticWorkload(seed=4, num_sessions=8).requests())
    # roomy: long decodes and nobody waiting, so engines jump far between completions
    config = EngineConfig() if workload == "roomy" else pressured()
    results = []
    for fast_forward in (True, False):
        done = await run_simulation(
            requests, config, workers=workers, fast_forward=fast_forward, **kwargs
        )  # type: ignore[arg-type]
        records = sorted(
            (r.request_id, r.worker, r.arrival_s, r.first_token_s, r.finish_s, r.preemptions)
            for e in done.engines
            for r in e.stats.requests
        )
        cut = (done.report.requests_unfinished, done.report.requests_unstarted)
        results.append((records, cut, [e.stats.steps for e in done.engines]))
    assert results[0] == results[1]
    assert results[0][0]  # something ran


@pytest.mark.parametrize("fast_forward", [True, False])
async def test_a_request_released_by_one_engine_meets_another_where_it_would_be(
    fast_forward: bool,
) -> None:
    # closed loop of 2, round-robin: "long" decodes alone on rank 0 (a jump could take
    # its 40 steps at once), "short" ends on rank 1 at 0.75 s and releases "next", which
    # goes to rank 0: it must be scheduled at rank 0's step boundary 0.75 s, not after
    # a jump that passed it
    requests = [spec("long", 10, 40), spec("short", 10, 3), spec("next", 10, 2)]
    _, records = await run(
        requests,
        workers=2,
        dispatch="round-robin",
        concurrency=2,
        fast_forward=fast_forward,
    )
    assert records["short"] == (0.0, 0.25, 0.75)
    assert records["next"] == (0.75, 1.0, 1.25)
    assert records["long"] == (0.0, 0.25, 10.0)


async def test_one_rank_in_lockstep_is_one_independent_engine() -> None:
    from kvpool.workloads import SyntheticWorkload

    requests = SyntheticWorkload(seed=3, num_sessions=6).requests()
    alone = await run_simulation(requests, pressured())
    locked = await run_simulation(requests, pressured(), lockstep=True)
    assert locked.report.total == alone.report.total
    assert locked.engines[0].stats.requests == alone.engines[0].stats.requests
