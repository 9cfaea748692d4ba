"""``--timing-model aic``: step times against aiconfigurator-core's own predictions
(asked of the library here, never copied), its planner-profile export, and the CLI.

One aiconfigurator engine (Qwen3-8B on one H200, vLLM, the database's current version)
is compiled per module (about 1.5 s) and shared. The tests that need the library skip
with a reason without it (``pip install 'kvpool[aic]'``); the ones that check what
happens without it run either way.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvpool.cli import main
from kvpool.engine import EngineConfig, ProfileTiming, StepWork, run_simulation
from kvpool.engine.record import RequestRecord
from kvpool.engine.timing import AIC_EXACT_CONTEXT, AicTiming, LatencyPredictor
from kvpool.errors import InvalidArgumentError
from kvpool.workloads import RequestSpec, Segment, SyntheticWorkload, mix_seed

MODEL = "Qwen/Qwen3-8B"
SYSTEM = "h200_sxm"
NO_AIC = "aiconfigurator-core is not installed (pip install 'kvpool[aic]')"


@pytest.fixture(scope="module")
def predictor() -> LatencyPredictor:
    pytest.importorskip("aiconfigurator_core", reason=NO_AIC)
    from kvpool.engine.aic import AicSpec, load_predictor

    compiled, _ = load_predictor(AicSpec(MODEL, SYSTEM, block_size=16))
    return compiled


def pf(predictor: LatencyPredictor, batch: int, isl: int, prefix: int) -> float:
    return max(0.0, predictor.predict_prefill_latency(batch, isl, prefix))


def dec(predictor: LatencyPredictor, batch: int, context: int) -> float:
    return max(1.0, predictor.predict_decode_latency(batch, context, 2))


def spec(name: str, arrival: float, prompt: tuple[Segment, ...], output: int) -> RequestSpec:
    return RequestSpec(name, arrival, prompt, Segment(mix_seed(*name.encode(), 1), output))


def simulate(
    timing: Any, requests: list[RequestSpec], *, fast_forward: bool = True, **config: Any
) -> tuple[dict[str, RequestRecord], Any]:
    engine_config = EngineConfig(timing=timing, enable_kv_cache_events=False, **config)

    async def go() -> Any:
        return await run_simulation(requests, engine_config, fast_forward=fast_forward)

    run = anyio.run(go)
    records = {r.request_id: r for engine in run.engines for r in engine.stats.requests}
    return records, run.report.total


# ------------------------------------------------------------------ step times


@pytest.mark.slow
@pytest.mark.parametrize("fast_forward", [True, False], ids=["fast-forward", "step-by-step"])
def test_a_request_alone_takes_the_latencies_aiconfigurator_predicts(
    predictor: LatencyPredictor, fast_forward: bool
) -> None:
    # 600 prompt tokens, 40 output tokens: its first step prefills the prompt and samples
    # token 1 at context 600; step k samples token k at context 599 + k. Exact queries
    # (context_bucket=1): each step is the library's prefill plus decode, nothing else.
    timing = AicTiming(predictor, context_bucket=1)
    request = spec("a", 0.0, (Segment(7, 600),), 40)
    records, total = simulate(timing, [request], fast_forward=fast_forward)
    record = records["a"]
    ttft = (pf(predictor, 1, 600, 0) + dec(predictor, 1, 600)) / 1e3
    assert record.first_token_s == pytest.approx(ttft, rel=1e-12)
    gaps = [dec(predictor, 1, 599 + k) / 1e3 for k in range(2, 41)]
    assert record.finish_s == pytest.approx(ttft + sum(gaps), rel=1e-12)
    assert total.itl_s.max == pytest.approx(max(gaps), rel=1e-12)
    assert total.itl_s.p50 == pytest.approx(sorted(gaps)[len(gaps) // 2], rel=1e-12)


def test_a_cached_prefix_shortens_ttft_as_the_prefix_argument_says(
    predictor: LatencyPredictor,
) -> None:
    # b arrives after a finished, its first 512 tokens (32 blocks) a's: it prefills 1000
    # tokens of which 512 are cached, isl 1000 and prefix 512 in aiconfigurator's terms.
    timing = AicTiming(predictor, context_bucket=1)
    a = spec("a", 0.0, (Segment(7, 1000),), 2)
    b = spec("b", 10.0, (Segment(7, 512), Segment(999_999, 488)), 2)
    records, _ = simulate(timing, [a, b])
    assert records["b"].cached_tokens == 512
    ttft_a = records["a"].first_token_s
    ttft_b = records["b"].first_token_s - 10.0  # type: ignore[operator]
    assert ttft_a == pytest.approx((pf(predictor, 1, 1000, 0) + dec(predictor, 1, 1000)) / 1e3)
    assert ttft_b == pytest.approx((pf(predictor, 1, 1000, 512) + dec(predictor, 1, 1000)) / 1e3)
    assert ttft_b < ttft_a  # type: ignore[operator]


def test_a_mixed_step_is_a_prefill_pass_plus_a_decode_pass_as_in_dynamo(
    predictor: LatencyPredictor,
) -> None:
    # Two requests prefill (prompt tokens 0 -> 700 and 300 -> 801), three sample a token
    # at contexts summing to 3000: Dynamo's integer means, isl 1501 // 2 = 750, prefix
    # 300 // 2 = 150, decode at 3000 // 3 = 1000.
    timing = AicTiming(predictor, context_bucket=1)
    work = StepWork(
        prefill_requests=2, prompt_start=300, prompt_end=1501, emitting=3, context_tokens=3000
    )
    expected = pf(predictor, 2, 750, 150) + dec(predictor, 3, 1000)
    assert timing.duration(work) == pytest.approx(expected / 1e3, rel=1e-12)
    # A batch whose integer means leave no new token costs no prefill (Dynamo's 0).
    nothing_new = StepWork(prefill_requests=2, prompt_start=200, prompt_end=201)
    assert timing.duration(nothing_new) == 0.0


def test_bucketed_decode_times_stay_within_the_stated_error(predictor: LatencyPredictor) -> None:
    timing = AicTiming(predictor)  # the default bucket
    worst = 0.0
    for batch in (1, 16, 128):
        for context in range(1, 33_000, 37):
            exact = predictor.predict_decode_latency(batch, context, 2)
            bucketed = timing.decode_ms(batch, context)
            if context < AIC_EXACT_CONTEXT:
                assert bucketed == exact
            worst = max(worst, abs(bucketed - exact) / exact)
    assert worst <= 0.005  # AicTiming's stated bound
    assert worst > 0  # the buckets were used


def test_a_bucket_is_an_int_of_at_least_one(predictor: LatencyPredictor) -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="context_bucket"):
            AicTiming(predictor, context_bucket=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------- planner profile


@pytest.fixture(scope="module")
def profile(predictor: LatencyPredictor) -> ProfileTiming:
    from kvpool.engine.aic import sample_profile

    return sample_profile(predictor, block_size=16, max_num_seqs=256)


def test_the_profile_holds_the_librarys_predictions_and_round_trips(
    predictor: LatencyPredictor, profile: ProfileTiming, tmp_path: Path
) -> None:
    for isl, ms in list(zip(profile.prefill_isl, profile.prefill_ttft_ms, strict=True))[::17]:
        assert ms == predictor.predict_prefill_latency(1, int(isl), 0)
    kv, context = profile.decode_active_kv_tokens, profile.decode_context_length
    for i in range(0, len(kv), 11):
        for j in range(0, len(context), 23):
            batch = min(max(round(kv[i] / context[j]), 1), 256)
            expected = predictor.predict_decode_latency(batch, int(context[j]), 2)
            assert profile.decode_itl[i][j] == expected
    path = tmp_path / "profile"  # no suffix: written where it is told, as it is told
    profile.to_npz(path)
    assert ProfileTiming.from_npz(path) == profile


@pytest.mark.parametrize(
    ("caching", "bounds"),
    [(False, (0.03, 0.03, 0.03)), (True, (0.01, 0.30, 0.10))],
    ids=["no-shared-prefix", "shared-prefixes"],
)
def test_simulating_with_the_profile_stays_close_to_simulating_with_aic(
    predictor: LatencyPredictor,
    profile: ProfileTiming,
    caching: bool,
    bounds: tuple[float, float, float],
) -> None:
    # The embedded workload (shared system prompts, multi-turn sessions), cut to 40
    # sessions on a pool they fill, with and without prefix caching. The stated bounds
    # (`sample_profile`), relative, on the run's simulated time, mean TTFT and mean ITL:
    # 3% each when no KV block is shared; with shared prefixes the profile takes a decode
    # batch from the active KV, which counts a shared block once, so it sees smaller
    # batches: 1%, 30% (TTFT here is mostly queueing, which amplifies it) and 10%.
    requests = SyntheticWorkload(num_sessions=40).requests()
    config = {"num_gpu_blocks": 512, "enable_prefix_caching": caching}
    _, direct = simulate(AicTiming(predictor), requests, **config)
    _, via_profile = simulate(profile, requests, **config)
    simulated, ttft, itl = bounds
    assert via_profile.simulated_s == pytest.approx(direct.simulated_s, rel=simulated)
    assert via_profile.ttft_s.mean == pytest.approx(direct.ttft_s.mean, rel=ttft)
    assert via_profile.itl_s.mean == pytest.approx(direct.itl_s.mean, rel=itl)


# ------------------------------------------------------------------------ CLI


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_simulates_and_profiles_with_aic(
    predictor: LatencyPredictor, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    common = ("--sessions", "5", "--kv-backend", "local", "--no-progress")
    report = tmp_path / "report.json"
    status, out, err = run_cli(
        capsys,
        "simulate",
        *common,
        "--timing-model",
        "aic",
        "--aic-model",
        MODEL,
        "--json",
        str(report),
    )
    assert status == 0, err
    direct = next(line for line in out.splitlines() if line.startswith("simulated time"))
    settings = json.loads(report.read_text())["settings"]
    # the report says what was predicted: the defaults, the version as a literal
    assert settings["aic_model"] == MODEL
    assert (settings["aic_system"], settings["aic_backend"]) == (SYSTEM, "vllm")
    assert settings["aic_backend_version"][0].isdigit()
    assert (settings["aic_tp_size"], settings["aic_context_bucket"]) == (1, 64)
    npz = tmp_path / "qwen3-8b.npz"
    status, out, err = run_cli(capsys, "profile", "--aic-model", MODEL, "-o", str(npz))
    assert status == 0, err
    assert f"wrote {npz}" in out
    status, out, err = run_cli(
        capsys, "simulate", *common, "--timing-model", "dynamo", "--planner-profile-data", str(npz)
    )
    assert status == 0, err
    via_profile = next(line for line in out.splitlines() if line.startswith("simulated time"))
    seconds = [float(line.split()[-1].rstrip("s")) for line in (direct, via_profile)]
    assert seconds[1] == pytest.approx(seconds[0], rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--aic-model", "Qwen/Qwen3-9B"],
            r"--aic-model Qwen/Qwen3-9B: .*bundled: .*Qwen/Qwen3-8B",
        ),
        (["--aic-model", MODEL, "--aic-system", "h999"], r"systems: .*h200_sxm"),
        (["--aic-model", MODEL, "--aic-backend", "tgi"], r"backends there: .*vllm"),
        (["--aic-model", MODEL, "--aic-backend-version", "0.1"], r"versions: .*\(current\)"),
        (["--aic-model", MODEL, "--aic-tp-size", "3"], r"cannot model .*divisible"),
    ],
    ids=["model", "system", "backend", "version", "tp-size"],
)
def test_what_the_database_lacks_is_a_one_line_error_listing_what_it_has(
    predictor: LatencyPredictor,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flags: list[str],
    message: str,
) -> None:
    report = tmp_path / "report.json"
    status, out, err = run_cli(
        capsys, "simulate", "--timing-model", "aic", *flags, "--json", str(report)
    )
    assert (status, out) == (1, "")
    assert err.count("\n") == 1
    assert err.startswith("kvpool simulate: error: ")
    assert re.search(message, err)
    assert not report.exists()  # nothing ran


def test_a_local_model_directory_is_read_as_its_config_json_says(
    predictor: LatencyPredictor, tmp_path: Path
) -> None:
    # The bundled Qwen3-8B config.json, copied into a directory of its own: the same model.
    import aiconfigurator_core

    from kvpool.engine.aic import AicSpec, load_predictor

    bundled = Path(aiconfigurator_core.__file__).parent / "model_configs"
    config = (bundled / "Qwen--Qwen3-8B_config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    local, version = load_predictor(AicSpec(str(tmp_path), SYSTEM))
    for args in ((1, 2048, 0), (4, 3000, 1000)):
        assert local.predict_prefill_latency(*args) == predictor.predict_prefill_latency(*args)
    assert local.predict_decode_latency(16, 2048, 2) == predictor.predict_decode_latency(
        16, 2048, 2
    )
    assert version.count(".") == 2  # a literal version, not the slot's name


def test_a_model_directory_needs_a_config_json(
    predictor: LatencyPredictor, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = run_cli(
        capsys, "simulate", "--timing-model", "aic", "--aic-model", str(tmp_path)
    )
    assert (status, out) == (1, "")
    assert f"--aic-model {tmp_path}: a directory with no config.json" in err


def test_the_aic_flags_go_with_the_aic_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--timing-model", "aic"])
    assert info.value.code == 2
    assert "--timing-model aic needs --aic-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--aic-system", "h100_sxm"])
    assert "--aic-system needs --timing-model aic" in capsys.readouterr().err


def test_without_the_extra_the_flag_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "aiconfigurator_core", None)
    status, out, err = run_cli(
        capsys, "simulate", "--timing-model", "aic", "--aic-model", MODEL, "--sessions", "2"
    )
    assert (status, out) == (1, "")
    assert err == (
        "kvpool simulate: error: --timing-model aic needs aiconfigurator-core: "
        "pip install 'kvpool[aic]'\n"
    )
    npz = tmp_path / "p.npz"
    status, out, err = run_cli(capsys, "profile", "--aic-model", MODEL, "-o", str(npz))
    assert (status, out) == (1, "")
    assert "kvpool profile needs aiconfigurator-core: pip install 'kvpool[aic]'" in err
    assert not npz.exists()
