"""Step-time models against step times computed by hand: the linear default, Dynamo's
polynomial, and Dynamo's interpolated planner profile (built here with numpy.savez).

Engine scenarios run on both KV backends and on every anyio backend.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import cli
from kvpool.engine import (
    Dynamo16ProfileTiming,
    Dynamo16Timing,
    DynamoTiming,
    EngineConfig,
    MockEngine,
    ProfileDataError,
    ProfileTiming,
    StepResult,
    StepTiming,
    StepWork,
    TimingModel,
)
from kvpool.engine.runner import KvFactory, open_actor_kv, open_local_kv
from kvpool.errors import InvalidArgumentError
from kvpool.flags.engine import engine_config
from kvpool.workloads import RequestSpec, Segment, mix_seed

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = [pytest.param(open_local_kv, id="local"), pytest.param(open_actor_kv, id="actor")]


@pytest.fixture(params=FACTORIES)
def kv_factory(request: pytest.FixtureRequest) -> KvFactory:
    factory: KvFactory = request.param
    return factory


def spec(name: str, prompt: int, output: int, *, prompt_seed: int | None = None) -> RequestSpec:
    seed = mix_seed(*name.encode()) if prompt_seed is None else prompt_seed
    return RequestSpec(
        name, 0.0, (Segment(seed, prompt),), Segment(mix_seed(*name.encode(), 1), output)
    )


async def durations(
    factory: KvFactory, timing: StepTiming, requests: list[RequestSpec], **config: Any
) -> list[StepResult]:
    """Run ``requests`` (all arriving at 0) to completion; return every step."""
    engine_config = EngineConfig(timing=timing, **config)
    async with factory(engine_config, 0) as kv:
        engine = MockEngine(kv, engine_config)
        for request in requests:
            await engine.submit(request)
        steps = []
        while engine.has_work:
            steps.append(await engine.step())
        await engine.final_usage()
    return steps


def poly_prefill_ms(t: float) -> float:
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def poly_decode_ms(p: float) -> float:
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


# ------------------------------------------------------------------ engine steps


@pytest.mark.anyio
async def test_the_linear_model_charges_overhead_prompt_tokens_and_decoding_sequences(
    kv_factory: KvFactory,
) -> None:
    steps = await durations(kv_factory, TimingModel(), [spec("a", 100, 3)], num_gpu_blocks=64)
    # step 1: 4 ms + 100 prompt tokens * 60 us = 10 ms; steps 2-3: 4 ms + 1 seq * 60 us
    assert [s.duration_s for s in steps] == pytest.approx([0.010, 0.00406, 0.00406])


costs = st.one_of(st.just(0.0), st.floats(1e-9, 1.0), st.integers(0, 3))


@given(costs, costs, costs, st.integers(0, 1 << 20), st.integers(0, 4096))
def test_the_linear_duration_is_its_step_time_bit_for_bit(
    overhead: float, per_token: float, per_seq: float, tokens: int, seqs: int
) -> None:
    """`TimingModel.duration` writes `step_time`'s sum out (it runs once a step): the
    same terms in the same order, so the same float."""
    model = TimingModel(overhead, per_token, per_seq)
    work = StepWork(prefill_tokens=tokens, decode_seqs=seqs)
    got, expected = model.duration(work), model.step_time(tokens, seqs)
    assert (type(got), repr(got)) == (type(expected), repr(expected))  # repr: every bit


@pytest.mark.anyio
async def test_dynamo_charges_prefill_for_prompt_tokens_and_decode_for_sampled_tokens(
    kv_factory: KvFactory,
) -> None:
    steps = await durations(kv_factory, DynamoTiming(), [spec("a", 100, 3)], num_gpu_blocks=64)
    # Step 1 computes T = 100 prompt tokens:
    #   prefill = 4.209989e-7 * 100^2 + 1.518344e-2 * 100 + 16.50142 = 18.023973989 ms
    # and samples the first token with 7 of 64 blocks active (ceil(100 / 16)), p = 0.109375:
    #   decode = -25.74 * 0.109375^2 + 54.01 * 0.109375 + 5.74 = 11.339418945... ms
    prefill = 0.004209989 + 1.518344 + 16.50142
    decode = -25.74 * 0.109375**2 + 54.01 * 0.109375 + 5.74
    assert prefill == pytest.approx(poly_prefill_ms(100))
    assert steps[0].duration_s == pytest.approx((prefill + decode) / 1e3)
    # Steps 2 and 3 decode tokens 101 and 102, still in 7 blocks: decode only.
    assert [s.duration_s for s in steps[1:]] == pytest.approx([decode / 1e3] * 2)


@pytest.mark.anyio
async def test_dynamo_16_charges_decode_only_for_requests_that_sampled_before(
    kv_factory: KvFactory,
) -> None:
    # ai-dynamo-runtime 1.6.1 (its replay gave these figures: TTFT 66.958095 ms, next
    # token 14.940288 ms later): step 1 only prefills the 3063-token prompt, and decodes
    # nothing (the token it samples is the first); step 2 decodes at p = its 3064 tokens
    # over 1024 blocks * 16 tokens.
    steps = await durations(kv_factory, Dynamo16Timing(), [spec("a", 3063, 3)], num_gpu_blocks=1024)
    assert steps[0].duration_s == pytest.approx(poly_prefill_ms(3063) / 1e3)
    assert steps[0].duration_s * 1e3 == pytest.approx(66.958095, abs=1e-6)
    assert steps[1].duration_s == pytest.approx(poly_decode_ms(3064 / 16384) / 1e3)
    assert steps[1].duration_s * 1e3 == pytest.approx(14.940288, abs=1e-6)


def test_dynamo_16_reads_usage_from_decoding_tokens_at_most_one() -> None:
    # prefix sharing can make the decoding sequences' tokens exceed the pool's
    work = StepWork(emitting=3, decoding=3, decode_context_tokens=20_000, capacity=1024)
    assert Dynamo16Timing().duration(work) == pytest.approx(poly_decode_ms(1.0) / 1e3)
    # a request finishing its prompt samples, but decodes nothing
    work = StepWork(prefill_requests=1, prompt_end=100, emitting=1, context_tokens=100)
    assert Dynamo16Timing().duration(work) == pytest.approx(poly_prefill_ms(100) / 1e3)
    assert Dynamo16Timing().duration(StepWork()) == 0.0


def test_dynamo_16_profile_charges_as_the_fixed_model_when_flat(tmp_path: Path) -> None:
    # flat tables: 1.6.1's fixed model, prefill 10 ms, decode 2 ms (its replay: a lone
    # request's TTFT is the prefill alone, each next token the decode)
    path = write_profile(
        tmp_path / "flat.npz", prefill_ttft_ms=[10.0] * 3, decode_itl=[[2.0, 2.0], [2.0, 2.0]]
    )
    profile = Dynamo16ProfileTiming.from_npz(path)
    prefill_only = StepWork(prefill_requests=1, prompt_end=100, emitting=1, context_tokens=100)
    assert profile.duration(prefill_only) == pytest.approx(0.010)
    both = StepWork(
        prefill_requests=1, prompt_end=100, emitting=2, decoding=1, decode_context_tokens=50
    )
    assert profile.duration(both) == pytest.approx(0.012)


@pytest.mark.anyio
async def test_dynamo_prefill_reads_the_batch_through_integer_means(
    kv_factory: KvFactory,
) -> None:
    # Two unrelated prompts, 100 and 51 tokens, in one step: Dynamo's T is
    # n * (sum(end) // n - sum(start) // n) = 2 * (151 // 2 - 0) = 150, not 151.
    # 7 + 4 blocks of 64 are active when both sample their first token.
    requests = [spec("a", 100, 1), spec("b", 51, 1)]
    steps = await durations(kv_factory, DynamoTiming(), requests, num_gpu_blocks=64)
    assert len(steps) == 1
    expected = poly_prefill_ms(150) + poly_decode_ms(11 / 64)
    assert steps[0].duration_s == pytest.approx(expected / 1e3)


@pytest.mark.anyio
async def test_dynamo_prefill_counts_only_what_the_same_step_duplicate_computes(
    kv_factory: KvFactory,
) -> None:
    # Two identical 1024-token prompts: a computes 1024, b reuses 1008 and computes 16.
    # start = 0 + 1008, end = 1024 + 1024: T = 2 * (2048 // 2 - 1008 // 2) = 1040.
    # a's 64 blocks plus b's own last block are active: p = 65 / 1024.
    requests = [spec(name, 1024, 1, prompt_seed=7) for name in ("a", "b")]
    steps = await durations(kv_factory, DynamoTiming(), requests, num_gpu_blocks=1024)
    assert steps[0].scheduled == {"a": 1024, "b": 16}
    expected = poly_prefill_ms(1040) + poly_decode_ms(65 / 1024)
    assert steps[0].duration_s == pytest.approx(expected / 1e3)


@pytest.mark.anyio
async def test_dynamo_reads_kv_usage_after_the_steps_preemptions(kv_factory: KvFactory) -> None:
    # Pool of 6 blocks of 4 (as in the FIFO victim scenario): in step 3 C needs a third
    # block and preempts A; A's 2nd block is evicted for C, its 1st stays idle. Active
    # after the step's allocations: B's 2 + C's 3 = 5 blocks, p = 5/6 (the engine's
    # running count, 6 + 1, would be wrong). B and C decode: no prefill in that step.
    requests = [spec(name, n, 10) for name, n in (("A", 6), ("B", 6), ("C", 7))]
    steps = await durations(
        kv_factory,
        DynamoTiming(),
        requests,
        num_gpu_blocks=6,
        block_size=4,
        preemption_mode="fifo",
        max_num_batched_tokens=64,
    )
    assert steps[2].preempted == ["A"]
    assert steps[2].duration_s == pytest.approx(poly_decode_ms(5 / 6) / 1e3)


# ---------------------------------------------------------------- the profile


def write_profile(path: Path, **overrides: Any) -> Path:
    arrays: dict[str, Any] = {
        "prefill_isl": [0, 1000, 2000],
        "prefill_ttft_ms": [10.0, 30.0, 70.0],
        "decode_active_kv_tokens": [0, 1024],
        "decode_context_length": [100, 200],
        "decode_itl": [[2.0, 4.0], [6.0, 10.0]],
    }
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
    return path


@pytest.mark.anyio
async def test_the_profile_interpolates_prefill_and_decode_times(
    kv_factory: KvFactory, tmp_path: Path
) -> None:
    profile = ProfileTiming.from_npz(write_profile(tmp_path / "profile.npz"))
    steps = await durations(kv_factory, profile, [spec("a", 100, 2)], num_gpu_blocks=64)
    # Step 1: prefill at T = 100: 10 + 100 * (30 - 10) / 1000 = 12 ms. Decode at
    # (7 blocks * 16 = 112 active KV tokens, context 100): tx = 112 / 1024 = 0.109375,
    # ty = 0: 2 + (6 - 2) * 0.109375 = 2.4375 ms.
    assert steps[0].duration_s == pytest.approx((12 + 2.4375) / 1e3)
    # Step 2 decodes with context 101: ty = 0.01, bilinear over the four corners.
    tx, ty = 0.109375, 0.01
    decode = 2 * (1 - tx) * (1 - ty) + 6 * tx * (1 - ty) + 4 * (1 - tx) * ty + 10 * tx * ty
    assert steps[1].duration_s == pytest.approx(decode / 1e3)


def test_the_profile_extrapolates_linearly_beyond_its_grid(tmp_path: Path) -> None:
    profile = ProfileTiming.from_npz(write_profile(tmp_path / "profile.npz"))
    # Prefill past 2000 follows the last segment: 70 + 1000 * (70 - 30) / 1000 = 110.
    assert profile.prefill_ms(3000) == pytest.approx(110.0)
    # Decode on unit coordinates is f(x, y) = 2 + 4x + 2y + 2xy; (2048, 300) is (2, 2):
    assert profile.decode_ms(2048, 300) == pytest.approx(2 + 8 + 4 + 8)
    # Below the grid, the first cell extends the same way: (-1024, 0) is (-1, -1).
    assert profile.decode_ms(-1024, 0) == pytest.approx(2 - 4 - 2 + 2)


def test_profile_times_are_clamped_as_dynamo_clamps_them(tmp_path: Path) -> None:
    # A falling prefill curve goes below 0 past its grid; decode under 1 ms counts as 1.
    path = write_profile(
        tmp_path / "p.npz",
        prefill_ttft_ms=[30.0, 20.0, 10.0],
        decode_itl=[[0.1, 0.1], [0.1, 0.1]],
    )
    profile = ProfileTiming.from_npz(path)
    work = StepWork(
        prefill_requests=1, prompt_start=0, prompt_end=5000, emitting=1, context_tokens=150
    )
    assert profile.prefill_ms(5000) == pytest.approx(-20.0)
    assert profile.duration(work) == pytest.approx((0.0 + 1.0) / 1e3)
    assert DynamoTiming().duration(StepWork()) == 0.0  # nothing computed, nothing charged


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill_isl": None}, "no array 'prefill_isl'"),
        ({"decode_itl": [2.0, 4.0]}, "decode_itl must be 2-D"),
        ({"prefill_isl": [[0, 1000, 2000]]}, "prefill_isl must be 1-D"),
        ({"prefill_ttft_ms": [10.0, 30.0]}, "prefill_ttft_ms has 2 values, expected 3"),
        ({"decode_itl": [[2.0, 4.0]]}, "decode_itl has 1 rows"),
        ({"decode_itl": [[2.0, 4.0, 5.0], [6.0, 10.0, 1.0]]}, "expected 2"),
        ({"prefill_ttft_ms": [10.0, float("nan"), 70.0]}, "non-finite"),
        ({"decode_itl": [[2.0, float("inf")], [6.0, 10.0]]}, "non-finite"),
        ({"prefill_isl": [0, 2000, 1000]}, "strictly increasing"),
        ({"decode_context_length": [100, 100]}, "strictly increasing"),
        ({"decode_active_kv_tokens": [0], "decode_itl": [[2.0, 4.0]]}, "at least 2 points"),
        ({"prefill_isl": ["a", "b", "c"]}, "not numeric"),
    ],
)
def test_a_bad_profile_is_a_one_line_typed_error(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    path = write_profile(tmp_path / "bad.npz", **overrides)
    with pytest.raises(ProfileDataError, match=message) as info:
        ProfileTiming.from_npz(path)
    assert isinstance(info.value, InvalidArgumentError)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_a_file_that_is_no_npz_is_a_typed_error(tmp_path: Path) -> None:
    text = tmp_path / "profile.npz"
    text.write_text("not a zip\n")
    for path in (text, tmp_path / "missing.npz"):
        with pytest.raises(ProfileDataError, match=r"not a readable \.npz profile"):
            ProfileTiming.from_npz(path)


def test_without_numpy_the_profile_asks_for_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(ImportError, match=r"pip install 'kvpool\[profile\]'"):
        ProfileTiming.from_npz("whatever.npz")


def test_a_config_refuses_a_timing_that_is_no_model() -> None:
    with pytest.raises(InvalidArgumentError, match="timing"):
        EngineConfig(timing=0.004)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ CLI


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_the_cli_runs_each_timing_model(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.npz")
    simulated = []
    for flags in (
        [],
        ["--timing-model", "dynamo"],
        ["--timing-model", "dynamo", "--planner-profile-data", str(profile)],
        ["--timing-model", "dynamo-1.6"],
    ):
        result = kvpool("simulate", "--sessions", "3", "--kv-backend", "local", *flags)
        assert result.returncode == 0, result.stderr
        line = next(s for s in result.stdout.splitlines() if s.startswith("simulated time"))
        simulated.append(line.split()[-1])
    assert len(set(simulated)) == 4  # each model timed the same steps differently


@pytest.mark.parametrize(
    ("flags", "model"),
    [
        (["--timing-model", "dynamo-1.6"], Dynamo16Timing),
        (["--timing-model", "dynamo-1.6", "--planner-profile-data", "P"], Dynamo16ProfileTiming),
        (["--timing-model", "dynamo", "--planner-profile-data", "P"], ProfileTiming),
    ],
)
def test_the_dynamo_release_picks_the_model(tmp_path: Path, flags: list[str], model: type) -> None:
    profile = str(write_profile(tmp_path / "profile.npz"))
    parser = cli.build_parser()
    args = parser.parse_args(["simulate", *(profile if f == "P" else f for f in flags)])
    assert type(engine_config(args, parser).timing) is model


def test_the_cli_refuses_a_bad_profile_in_one_line_before_the_run(tmp_path: Path) -> None:
    bad = write_profile(tmp_path / "bad.npz", decode_itl=[1.0, 2.0])
    result = kvpool(
        "simulate",
        "--sessions",
        "3",
        "--timing-model",
        "dynamo",
        "--planner-profile-data",
        str(bad),
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "decode_itl must be 2-D" in result.stderr


def test_the_cli_wants_the_dynamo_model_for_a_profile(tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.npz")
    result = kvpool("simulate", "--planner-profile-data", str(profile))
    assert result.returncode == 2
    assert "--planner-profile-data needs --timing-model dynamo" in result.stderr
    help_text = kvpool("simulate", "--help").stdout
    assert "--timing-model" in help_text
    assert "--planner-profile-data" in help_text
