"""``kvpool simulate``'s Dynamo-replay workload flags: bad values are one-line usage
errors with nothing run (in process: fast), and the flags reach the run (a few runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool import cli

SYNTHETIC = ["--synthetic", "--input-tokens", "100", "--output-tokens", "4"]
SMALL = [*SYNTHETIC, "--request-count", "6"]
HUGE = [*SYNTHETIC, "--concurrency", "1", "--request-count", "1000", "--turns-per-session", "1001"]


def usage_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """The one-line error of ``kvpool simulate FLAGS`` (exit status 2, nothing printed
    on stdout: nothing ran)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["simulate", "--no-progress", *flags])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith(("kvpool simulate: error: ", "kvpool: error: "))
    return last


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "must be in [1, 1000000]"),
        (["--replay-concurrency", "x"], "not an integer"),
        (["--arrival-speedup-ratio", "0"], "must be in (0, 1e+09]"),
        (["--arrival-speedup-ratio", "nan"], "must be in (0, 1e+09]"),
        (["--max-sim-time-s", "-1"], "must be in (0, 1e+09]"),
        (["--max-sim-time-s", "inf"], "must be in (0, 1e+09]"),
        (["--max-model-len", "0"], "must be in [1, "),
        (["--sla-ttft-ms", "0"], "must be in (0, "),
        (["--sla-itl-ms", "-5"], "must be in (0, "),
        (["--sla-e2e-ms", "nan"], "must be in (0, "),
        (["--shared-prefix-ratio", "1.5"], "must be in [0, 1]"),
        (["--request-rate", "0"], "must be in (0, 1e+09]"),
        (["--input-tokens", "0"], "must be in [1, "),
        (["--concurrency", "2", "--arrival-speedup-ratio", "2"], "--concurrency reads none"),
        (["--input-tokens", "10"], "--input-tokens shapes the --synthetic workload"),
        (["--turns-per-session", "3"], "add --synthetic"),
        ([*SYNTHETIC, "--request-count", "3"], "needs exactly one of --request-rate"),
        (
            [*SMALL, "--request-rate", "1", "--arrival-interval-ms", "5"],
            "needs exactly one of --request-rate",
        ),
        (["--synthetic", "--input-tokens", "10"], "needs --output-tokens, --request-count"),
        ([*SMALL, "--concurrency", "2", "--trace", "t.jsonl"], "choose one"),
        ([*SMALL, "--concurrency", "2", "--sessions", "5"], "--sessions shapes the embedded"),
        ([*SMALL, "--concurrency", "2", "--shared-prefix-ratio", "0.5"], "need each other"),
        ([*SMALL, "--concurrency", "2", "--num-prefix-groups", "2"], "need each other"),
        ([*SMALL, "--concurrency", "2", "--inter-turn-delay-ms", "5"], "--turns-per-session"),
        (HUGE, "must be <= 1000000"),
    ],
)
def test_a_bad_workload_flag_is_a_one_line_usage_error(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert message in usage_error(capsys, *flags)


def run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str) -> dict[str, object]:
    report = tmp_path / "report.json"
    status = cli.main(
        ["simulate", "--no-progress", "--kv-backend", "local", "--json", str(report), *flags]
    )
    out, _ = capsys.readouterr()
    assert status == 0, out
    decoded: dict[str, object] = json.loads(report.read_text())
    decoded["text"] = out
    return decoded


def test_a_synthetic_closed_loop_run_is_reported_with_goodput_and_the_cut(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 4 ms per step and 60 us per prompt token (the default linear model): a request
    # alone takes 10 ms to its first token and 4.06 ms per later one, 22.18 ms in all
    flags = [*SMALL, "--concurrency", "1", "--sla-ttft-ms", "10.5", "--sla-e2e-ms", "22.2"]
    report = run(capsys, tmp_path, *flags, "--max-sim-time-s", "0.05")
    total = report["total"]
    assert isinstance(total, dict)
    # closed loop, one at a time: requests end at 22.18 and 44.36 ms; the third, sent at
    # 44.36 ms, is still running when the clock stops at 50 ms; three never start
    assert total["requests_completed"] == 2
    assert (report["requests_unfinished"], report["requests_unstarted"]) == (1, 3)
    assert total["goodput"]["goodput_completed_requests"] == 2
    assert report["sla"] == {"ttft_ms": 10.5, "itl_ms": None, "e2e_ms": 22.2}
    text = report["text"]
    assert isinstance(text, str)
    assert "goodput requests (TTFT <= 10.5 ms, E2E <= 22.2 ms)" in text
    assert "1 requests unfinished (aborted in flight), 3 unstarted" in text
    assert "synthetic workload (seed 0, 6 sessions x 1 turns = 6 requests" in text


def test_the_same_seed_gives_the_same_synthetic_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    flags = [*SMALL, "--request-rate", "50", "--num-prefix-groups", "2"]
    flags += ["--shared-prefix-ratio", "0.5", "--turns-per-session", "2"]
    first = run(capsys, tmp_path, *flags)
    again = run(capsys, tmp_path, *flags)
    other = run(capsys, tmp_path, *flags, "--seed", "1")
    assert first["total"] == again["total"]
    assert first["total"] != other["total"]


def test_max_model_len_rejections_are_counted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = run(capsys, tmp_path, *SMALL, "--concurrency", "3", "--max-model-len", "103")
    total = report["total"]
    assert isinstance(total, dict)
    assert (total["requests_rejected"], total["requests_completed"]) == (6, 0)
    report = run(capsys, tmp_path, *SMALL, "--concurrency", "3", "--max-model-len", "104")
    total = report["total"]
    assert isinstance(total, dict)
    assert (total["requests_rejected"], total["requests_completed"]) == (0, 6)


def test_lockstep_ranks_share_one_clock(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    flags = [*SMALL, "--arrival-interval-ms", "3", "--workers", "2"]
    alone = run(capsys, tmp_path, *flags)
    locked = run(capsys, tmp_path, *flags, "--data-parallel-lockstep")
    workers = locked["workers"]
    assert isinstance(workers, list)
    assert workers[0]["simulated_s"] == workers[1]["simulated_s"]
    assert locked["total"]["requests_completed"] == 6  # type: ignore[index]
    # an idle rank waits for the busy one's step: latencies can only grow
    assert locked["total"]["ttft_s"]["mean"] >= alone["total"]["ttft_s"]["mean"]  # type: ignore[index]


def test_help_documents_the_workload_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--help"])
    out, _ = capsys.readouterr()
    for flag in (
        "--synthetic",
        "--input-tokens",
        "--output-tokens",
        "--request-count",
        "--request-rate",
        "--arrival-interval-ms",
        "--turns-per-session",
        "--inter-turn-delay-ms",
        "--shared-prefix-ratio",
        "--num-prefix-groups",
        "--concurrency",
        "--replay-concurrency",
        "--arrival-speedup-ratio",
        "--max-sim-time-s",
        "--max-model-len",
        "--data-parallel-lockstep",
        "--sla-ttft-ms",
        "--sla-itl-ms",
        "--sla-e2e-ms",
    ):
        assert flag in out, flag
