"""Admission of waiting and preempted requests as vLLM 0.33 decides it by default
(``scheduler_reserve_full_isl``: the whole sequence must fit) and with its ``watermark``.

Every case is small enough to follow by hand: block size 16, a budget of 32 tokens, a
pool of a few blocks; the comments give the arithmetic the assertions check.
"""

from __future__ import annotations

import pytest

from kvpool import cli
from kvpool.engine import EngineConfig, LocalKvClient, MockEngine, StepResult
from kvpool.errors import InvalidArgumentError
from kvpool.flags.engine import engine_config
from kvpool.workloads import RequestSpec, Segment, mix_seed

pytestmark = pytest.mark.anyio

BS = 16
BUDGET = 32


def spec(name: str, prompt: int, output: int, *, prefix: Segment | None = None) -> RequestSpec:
    """A request whose tokens are unique to ``name``, after an optional shared ``prefix``."""
    seed = mix_seed(*name.encode())
    segments = (Segment(seed, prompt),) if prefix is None else (prefix, Segment(seed, prompt))
    return RequestSpec(name, 0.0, segments, Segment(mix_seed(seed, 1), output))


def make_engine(blocks: int, **overrides: object) -> MockEngine:
    config = EngineConfig(
        num_gpu_blocks=blocks,
        block_size=BS,
        max_num_batched_tokens=BUDGET,
        **overrides,  # type: ignore[arg-type]
    )
    kv = LocalKvClient.create(
        blocks, BS, enable_prefix_caching=config.enable_prefix_caching, enable_kv_cache_events=False
    )
    return MockEngine(kv, config)


async def steps(engine: MockEngine, count: int) -> list[StepResult]:
    return [await engine.step() for _ in range(count)]


async def prefilled(engine: MockEngine, prompt: int = 64, output: int = 40) -> None:
    """Run request A (``prompt`` tokens, 2 steps of 32) until it has its first token."""
    await engine.submit(spec("A", prompt, output))
    await steps(engine, prompt // BUDGET)
    assert engine.running[0].num_output == 1


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("full", [True, False])
async def test_a_waiting_prompt_whose_chunk_fits_but_not_whole(caching: bool, full: bool) -> None:
    # 8 blocks. A (64-token prompt) holds 4, and its first decode takes a 5th: 3 free.
    # B's 80-token prompt needs 5 blocks whole; its first chunk (31 tokens: the budget
    # less A's decode token) needs 2.
    engine = make_engine(
        8, enable_prefix_caching=caching, scheduler_reserve_full_isl=full, max_num_seqs=4
    )
    await prefilled(engine)
    await engine.submit(spec("B", 80, 2))
    (step,) = await steps(engine, 1)
    if full:
        assert step.scheduled == {"A": 1}  # 5 > 3: B waits
        assert engine.waiting[0].request_id == "B"
    else:
        assert step.scheduled == {"A": 1, "B": 31}  # 2 <= 3: admitted
        # next step B's chunk through 62 tokens needs 4 blocks, 1 free: B, the newest,
        # is the victim (LIFO), before A's decode even needs anything
        (step,) = await steps(engine, 1)
        assert step.preempted == ["B"]
    while engine.has_work:
        await engine.step()
    assert engine.stats.completed == 2
    assert (engine.stats.preemptions == 0) is full


async def test_a_prefix_in_use_by_a_running_request_costs_no_free_block() -> None:
    # As above, but B's first 64 tokens are A's prompt, its 4 blocks active in A:
    # B's whole 80 tokens need 5 - 4 = 1 fresh block of the 3 free, so it is admitted
    # with its last 16 tokens; a unique prompt of the same length waits.
    engine = make_engine(8)
    await prefilled(engine)
    a_prompt = engine.running[0].spec.prompt[0]
    await engine.submit(spec("B", 16, 2, prefix=a_prompt))
    await engine.submit(spec("C", 80, 2))
    (step,) = await steps(engine, 1)
    assert step.scheduled == {"A": 1, "B": 16}
    assert [r.request_id for r in engine.waiting] == ["C"]


@pytest.mark.parametrize(
    ("blocks", "full", "admitted"), [(11, True, False), (11, False, True), (12, True, True)]
)
async def test_an_idle_cached_prefix_counts_as_taken_from_the_free_queue(
    blocks: int, full: bool, admitted: bool
) -> None:
    # P (64 tokens, one output token) runs and finishes: its 4 blocks stay cached, idle,
    # at the free queue's tail. A (64 tokens) then takes 4 never-used blocks and its
    # first decode a 5th: blocks - 5 are free or evictable, P's 4 among them.
    # B = P's prompt + 48 tokens (7 blocks) reuses P's 4: its first chunk (31 tokens,
    # through 95) needs 2 fresh blocks plus the 4 it takes out of the free queue (6), its
    # whole prompt 3 + 4 = 7. With 11 blocks 6 are free: only the chunk fits.
    engine = make_engine(blocks, scheduler_reserve_full_isl=full)
    prompt = Segment(mix_seed(7), 64)
    await engine.submit(RequestSpec("P", 0.0, (prompt,), Segment(mix_seed(8), 1)))
    await steps(engine, 2)
    assert not engine.has_work
    await prefilled(engine)
    await engine.submit(spec("B", 48, 2, prefix=prompt))
    (step,) = await steps(engine, 1)
    assert step.scheduled == ({"A": 1, "B": 31} if admitted else {"A": 1})
    if admitted:
        assert engine.running[1].cached_tokens == 64


@pytest.mark.parametrize("full", [True, False])
async def test_a_preempted_request_must_fit_with_its_output_so_far(full: bool) -> None:
    # 6 blocks, no prefix caching. A (32-token prompt, 60 out: 6 blocks at most) runs;
    # B (16 tokens, 60 out) is admitted beside it in step 2 and both decode. In step 18
    # A computes token 48 and takes its 4th block, the last free one; in step 19 B
    # computes token 32, needs a 3rd and is its own victim (LIFO), with 33 tokens (its
    # 16 and 17 sampled). Re-admitting B needs 3 blocks whole, 2 for its first chunk
    # (31 tokens), and A holds 4 of the 6.
    engine = make_engine(6, enable_prefix_caching=False, scheduler_reserve_full_isl=full)
    await engine.submit(spec("A", 32, 60))
    await steps(engine, 1)
    await engine.submit(spec("B", 16, 60))
    history = await steps(engine, 18)
    assert [step.preempted for step in history].index(["B"]) == 17  # step 19
    victim = engine.waiting[0]
    assert (victim.request_id, victim.num_tokens, engine.running[0].num_blocks) == ("B", 33, 4)
    (step,) = await steps(engine, 1)
    if full:
        assert step.scheduled == {"A": 1}  # 3 > 2 free: B waits until A finishes
        while engine.has_work:
            step = await engine.step()
            if "B" in step.scheduled:
                assert engine.stats.completed == 1  # A's
                break
        assert engine.stats.preemptions == 1
    else:
        assert step.scheduled == {"A": 1, "B": 31}  # 2 <= 2: back in, to thrash
        while engine.has_work:
            await engine.step()
        assert engine.stats.preemptions > 1
    while engine.has_work:
        await engine.step()
    assert engine.stats.completed == 2


@pytest.mark.parametrize(
    ("watermark", "prompt", "admitted"), [(0.25, 48, True), (0.25, 64, False), (0.0, 64, True)]
)
async def test_the_watermark_keeps_blocks_free_while_a_request_runs(
    watermark: float, prompt: int, admitted: bool
) -> None:
    # 10 blocks, watermark 0.25: int(2.5) = 2 blocks. A (64 tokens) holds 4 and its
    # first decode a 5th: 5 free. B of 48 tokens (3 blocks) leaves 2: admitted; of 64
    # tokens (4 blocks) it would leave 1: waits, where without the watermark it fits.
    assert EngineConfig(num_gpu_blocks=10, watermark=watermark).watermark_blocks == (
        2 if watermark else 0
    )
    engine = make_engine(10, watermark=watermark)
    await prefilled(engine)
    await engine.submit(spec("B", prompt, 2))
    (step,) = await steps(engine, 1)
    assert step.scheduled == ({"A": 1, "B": 31} if admitted else {"A": 1})


async def test_the_watermark_does_not_hold_back_a_request_into_an_idle_engine() -> None:
    # vLLM applies it only while some request runs (has_scheduled_reqs): a request
    # needing all 10 blocks (159 + 2 - 1 = 160 tokens) starts in an idle engine.
    engine = make_engine(10, watermark=0.5)
    await engine.submit(spec("A", 159, 2))
    (step,) = await steps(engine, 1)
    assert step.scheduled == {"A": 32}
    while engine.has_work:
        await engine.step()
    assert engine.stats.completed == 1
    assert engine.stats.preemptions == 0


@pytest.mark.parametrize("watermark", [-0.1, 1.0, 2, True, "0.1"])
def test_a_watermark_outside_zero_to_one_is_refused(watermark: object) -> None:
    with pytest.raises(InvalidArgumentError, match="watermark"):
        EngineConfig(watermark=watermark)  # type: ignore[arg-type]


def test_scheduler_reserve_full_isl_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="scheduler_reserve_full_isl"):
        EngineConfig(scheduler_reserve_full_isl=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_the_admission_flags_reach_the_engine_config(command: str) -> None:
    parser = cli.build_parser()
    default = engine_config(parser.parse_args([command]), parser)
    assert default.scheduler_reserve_full_isl is True  # vLLM's default
    assert default.watermark == 0.0
    flags = [command, "--no-scheduler-reserve-full-isl", "--watermark", "0.05"]
    config = engine_config(parser.parse_args(flags), parser)
    assert config.scheduler_reserve_full_isl is False
    assert config.watermark == 0.05


@pytest.mark.parametrize(
    ("value", "message"),
    [("1", "watermark must be a number in [0, 1)"), ("-0.5", "must be a finite number >= 0")],
)
def test_a_bad_watermark_is_a_usage_error(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exited:
        engine_config(parser.parse_args(["simulate", "--watermark", value]), parser)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
