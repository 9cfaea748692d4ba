"""``kvpool sweep``: the grid it spans, its reports (each the one ``kvpool simulate``
writes for the same flags), failed runs, bad specs, the table and the plot."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool import cli
from kvpool.cli.sweep import GridError, build_grid
from kvpool.cli.sweep.grid import parse_grid_flag, read_grid_file
from kvpool.cli.sweep.table import METRICS, figures

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TRACE = ROOT / "kvpool" / "data" / "sample_trace.jsonl"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# the report's wall-clock figures: the only ones two runs of one configuration differ in
WALL = ("wall_s", "requests_per_wall_s")
SMALL = ("--grid", "sessions=3", "--grid", "kv-backend=local")


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """The first 40 requests of the sample trace: a run of a fraction of a second."""
    path = tmp_path / "small.jsonl"
    lines = SAMPLE_TRACE.read_text().splitlines(keepends=True)[:40]
    path.write_text("".join(lines))
    return path


def sweep(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["sweep", *args])
    out, err = capsys.readouterr()
    return status, out, err


def simulate_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> dict[str, Any]:
    target = tmp_path / "alone.json"
    assert cli.main(["simulate", *argv, "--json", str(target)]) == 0
    capsys.readouterr()
    report: dict[str, Any] = json.loads(target.read_bytes())
    return report


def without_wall(report: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in report.items() if key not in WALL}


def argv_of(params: dict[str, str]) -> list[str]:
    """The ``kvpool simulate`` flags a sweep run's parameters stand for, built here as a
    user would type them (not by the sweep's own code)."""
    argv: list[str] = []
    for key, value in params.items():
        if value in ("true", "false"):
            argv.append(f"--{key}" if value == "true" else f"--no-{key}")
        else:
            argv += [f"--{key}", value]
    return argv


def test_the_grid_is_every_combination_the_last_axis_fastest() -> None:
    grid = build_grid(
        [
            ("num-gpu-blocks", ["512", "1024"]),
            ("data_parallel_size", ["1", "2"]),  # an alias, with underscores
            ("enable-prefix-caching", ["true", "false"]),
            ("seed", ["7"]),
        ]
    )
    assert [axis.key for axis in grid.axes] == [
        "num-gpu-blocks",
        "workers",
        "enable-prefix-caching",
        "seed",
    ]
    assert [axis.key for axis in grid.swept] == [
        "num-gpu-blocks",
        "workers",
        "enable-prefix-caching",
    ]
    assert len(grid.runs) == 8
    assert [run.index for run in grid.runs] == list(range(8))
    assert [run.params["enable-prefix-caching"] for run in grid.runs[:2]] == ["true", "false"]
    assert [run.params["num-gpu-blocks"] for run in grid.runs] == ["512"] * 4 + ["1024"] * 4
    assert grid.runs[1].argv == (
        "--num-gpu-blocks=512",
        "--workers=1",
        "--no-enable-prefix-caching",
        "--seed=7",
    )


def test_a_range_is_pythons() -> None:
    assert parse_grid_flag("num-gpu-blocks=range(1024,4097,1024)") == (
        "num-gpu-blocks",
        [str(n) for n in range(1024, 4097, 1024)],
    )
    assert parse_grid_flag("seed=range(3, 0, -1)")[1] == ["3", "2", "1"]
    for bad in ("seed=range(1,2,0)", "seed=range(5,1)", "seed=range(1.5,3)"):
        with pytest.raises(GridError):
            parse_grid_flag(bad)


def test_summary_goes_to_stderr_when_a_table_is_on_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = sweep(capsys, *SMALL, "--grid", "seed=1,2", "--jobs", "1", "--csv", "-")
    assert status == 0, err
    lines = list(csv.DictReader(io.StringIO(out)))
    assert [line["seed"] for line in lines] == ["1", "2"]
    assert "TTFT p99 ms" in err  # the summary's heading


def test_a_toml_file_spans_the_grid_its_flags_would(tmp_path: Path) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(
        "[grid]\nnum-gpu-blocks = [512, 1024]\ndispatch = ['least-loaded', 'round-robin']\n"
        "fast-forward = false\narrival-speedup-ratio = 2.5\n"
    )
    from_file = build_grid(read_grid_file(path))
    from_flags = build_grid(
        parse_grid_flag(text)
        for text in (
            "num-gpu-blocks=512,1024",
            "dispatch=least-loaded,round-robin",
            "fast-forward=false",
            "arrival-speedup-ratio=2.5",
        )
    )
    assert from_file == from_flags


def test_each_report_is_the_one_simulate_writes_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    """Two processes, two traces, the actor backend and the local one: every report
    equals kvpool simulate's for the same flags."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(SAMPLE_TRACE.read_text().splitlines(keepends=True)[40:70]))
    table = tmp_path / "table.json"
    status, out, err = sweep(
        capsys,
        "--trace",
        str(trace),
        "--trace",
        str(other),
        "--grid",
        "kv-backend=actor,local",
        "--grid",
        "num-gpu-blocks=128",
        "--jobs",
        "2",
        "--json",
        str(table),
    )
    assert status == 0, err
    assert "[4/4]" in err  # progress: a line per run
    data = json.loads(table.read_bytes())
    assert data["grid"]["trace"] == [str(trace), str(other)]
    assert len(data["runs"]) == 4
    assert "actor" in out  # the summary on stdout, by the swept flags
    for row in data["runs"]:
        assert row["status"] == "ok"
        alone = simulate_alone(capsys, tmp_path, argv_of(row["params"]))
        assert without_wall(row["report"]) == without_wall(alone)


def test_inline_runs_give_the_same_reports(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    table = tmp_path / "table.json"
    status, _, err = sweep(
        capsys, *SMALL, "--grid", "dispatch=least-loaded,round-robin", "--grid", "workers=2",
        "--jobs", "1", "--json", str(table),
    )  # fmt: skip
    assert status == 0, err
    for row in json.loads(table.read_bytes())["runs"]:
        alone = simulate_alone(capsys, tmp_path, argv_of(row["params"]))
        assert without_wall(row["report"]) == without_wall(alone)


def test_a_failed_run_is_reported_and_the_others_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 10}\nnot json\n')
    table, rows = tmp_path / "t.json", tmp_path / "t.csv"
    status, out, err = sweep(
        capsys,
        "--grid",
        f"trace={broken},{trace}",
        "--grid",
        "num-gpu-blocks=64,256",
        "--json",
        str(table),
        "--csv",
        str(rows),
    )
    assert status == 1
    runs = json.loads(table.read_bytes())["runs"]
    assert [row["status"] for row in runs] == ["failed", "failed", "ok", "ok"]
    assert all("TraceError" in row["error"] and row["report"] is None for row in runs[:2])
    assert all(row["error"] is None and row["report"] for row in runs[2:])
    assert "FAILED: TraceError" in err
    assert "failed: TraceError" in out
    lines = list(csv.DictReader(io.StringIO(rows.read_text())))
    assert [line["status"] for line in lines] == ["failed", "failed", "ok", "ok"]
    assert lines[0]["ttft_s.p99"] == ""


def test_the_csv_holds_the_reports_figures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    table, rows = tmp_path / "t.json", tmp_path / "t.csv"
    status, _, err = sweep(
        capsys, *SMALL, "--grid", "num-gpu-blocks=96,384", "--jobs", "1",
        "--json", str(table), "--csv", str(rows),
    )  # fmt: skip
    assert status == 0, err
    reports = [row["report"] for row in json.loads(table.read_bytes())["runs"]]
    lines = list(csv.DictReader(io.StringIO(rows.read_text())))
    assert [line["num-gpu-blocks"] for line in lines] == ["96", "384"]
    assert list(lines[0])[-len(METRICS) :] == list(METRICS)
    for line, report in zip(lines, reports, strict=True):
        assert float(line["ttft_s.p99"]) == report["total"]["ttft_s"]["p99"]
        assert int(line["evictions"]) == report["total"]["evictions"]
        assert float(line["kv_usage.mean"]) == report["total"]["kv_usage"]["mean"]
        assert figures(report)["preemptions"] == report["total"]["preemptions"]
    assert [int(line["num_gpu_blocks"]) for line in lines] == [96, 384]  # the pool's own


def test_the_plot_draws_the_metrics_against_the_swept_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvpool.cli.sweep.execute import Outcome
    from kvpool.cli.sweep.plot import plot_lines

    image, table = tmp_path / "sweep.png", tmp_path / "t.json"
    status, _, err = sweep(
        capsys, *SMALL, "--grid", "dispatch=least-loaded,round-robin", "--grid", "workers=2",
        "--grid", "num-gpu-blocks=64,256", "--jobs", "1", "--plot", str(image),
        "--plot-metric", "ttft_s.p99", "--plot-metric", "evictions", "--json", str(table),
    )  # fmt: skip
    assert status == 0, err
    assert image.read_bytes().startswith(PNG_SIGNATURE)
    # the lines drawn: x is the numeric flag, a line per dispatch policy
    data = json.loads(table.read_bytes())
    grid = build_grid(list(data["grid"].items()))
    outcomes = [
        Outcome(run, json.dumps(row["report"]).encode(), None, 0.0)
        for run, row in zip(grid.runs, data["runs"], strict=True)
    ]
    positions, ticks, lines = plot_lines(grid, outcomes, "num-gpu-blocks", "evictions")
    assert positions == [64.0, 256.0]
    assert ticks == ["64", "256"]
    assert set(lines) == {"dispatch=least-loaded", "dispatch=round-robin"}
    expected = [
        float(row["report"]["total"]["evictions"])
        for row in data["runs"]
        if row["params"]["dispatch"] == "round-robin"
    ]
    assert lines["dispatch=round-robin"] == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "num-gpu-blocks"], "expected KEY=VALUE"),
        (["--grid", "num-gpu-blocks=1,,2"], "an empty value"),
        (["--grid", "no-such-flag=1"], "has no flag --no-such-flag"),
        (["--grid", "num-gpu-blocks=0,16"], "--grid num-gpu-blocks=0: argument --num-gpu-blocks"),
        (["--grid", "dispatch=fastest"], "invalid choice"),
        (["--grid", "fast-forward=maybe"], "a switch takes true or false"),
        (["--grid", "num-gpu-blocks=16,16"], "a value is repeated"),
        (["--grid", "seed=1", "--grid", "seed=2"], "given twice"),
        (["--grid", "json=out.json"], "not in a sweep"),
        (["--grid", "zmq-kv-event-port=5557"], "not in a sweep"),
        (["--grid", "trace=-"], "not from stdin"),
        (["--grid", "trace=/no/such.jsonl"], "no such readable file"),
        (["--trace", str(SAMPLE_TRACE), "--grid", "seed=1,2"], "--seed and --sessions"),
        (["--grid", "input-tokens=10"], "run 0 (input-tokens=10)"),
        ([], "nothing to sweep"),
        (["--grid", "seed=1,2", "--plot-metric", "ttft_s.p99"], "need --plot"),
        (["--grid", "seed=1,2", "--plot", "x.png", "--plot-metric", "speed"], "not a column"),
        (
            ["--grid", "seed=1,2", "--grid", "workers=2", "--plot", "x.png", "--plot-x", "workers"],
            "takes one value only",
        ),
        (["--grid", "seed=1", "--plot", "x.png"], "no flag takes more than one value"),
    ],
)
def test_a_bad_grid_is_a_one_line_error_and_nothing_runs(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", *args, "--json", "table.json"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvpool sweep: error: "), err
    assert message in last
    assert "at a time" not in err  # no run started
    assert out == ""
    assert list(tmp_path.iterdir()) == []


def dies_on_64_blocks(argv: Sequence[str]) -> tuple[bytes | None, str | None, float]:
    """A worker task that kills its process for one configuration (as the OOM killer or
    a crash in compiled code would), and runs the others as the sweep does."""
    if "--num-gpu-blocks=64" in argv:
        os._exit(9)
    from kvpool.cli.sweep.execute import run_configuration

    report, error = run_configuration(argv)
    return report, error, 0.0


@pytest.mark.slow
def test_a_worker_process_that_dies_fails_its_run_only() -> None:
    from kvpool.cli.sweep.execute import run_in_processes

    grid = build_grid(
        [("num-gpu-blocks", ["32", "64", "128", "256"]), ("sessions", ["2"]),
         ("kv-backend", ["local"])]
    )  # fmt: skip
    outcomes = sorted(run_in_processes(grid.runs, 2, dies_on_64_blocks), key=lambda o: o.run.index)
    assert [o.run.index for o in outcomes] == [0, 1, 2, 3]
    assert [o.ok for o in outcomes] == [True, False, True, True]
    assert outcomes[1].error is not None
    assert "worker process died" in outcomes[1].error
    assert all(o.report_json for o in (outcomes[0], *outcomes[2:]))


def test_a_bad_toml_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sweep.toml"
    for text, message in (
        ("grid = 3\n", "no [grid] table"),
        ("[grid]\nseed = [[1]]\n", "not a string, number or boolean"),
        ("[other]\nseed = 1\n", "unknown key 'other'"),
        ("[grid\n", "is not TOML"),
    ):
        path.write_text(text)
        with pytest.raises(GridError, match=re.escape(message)):
            read_grid_file(path)


def test_an_unwritable_output_fails_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = sweep(capsys, *SMALL, "--csv", str(tmp_path / "no" / "t.csv"))
    assert status == 1
    assert err.strip() == f"kvpool sweep: error: --csv: no such directory: {tmp_path / 'no'}"
    assert out == ""


@pytest.mark.slow
def test_on_a_local_ray_cluster_the_reports_are_the_same(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace: Path
) -> None:
    """``--ray local`` starts Ray here (in a subprocess, as a user runs it: Ray's
    threads, signal handlers and exit hooks stay out of the test process)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'kvpool[ray]')")
    table = tmp_path / "ray.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "sweep", "--trace", str(trace),
         "--grid", "num-gpu-blocks=128,512", "--ray", "local", "--jobs", "2",
         "--json", str(table)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "on Ray" in done.stderr
    assert "[2/2]" in done.stderr
    runs = json.loads(table.read_bytes())["runs"]
    assert [row["params"]["num-gpu-blocks"] for row in runs] == ["128", "512"]
    for row in runs:
        alone = simulate_alone(capsys, tmp_path, argv_of(row["params"]))
        assert without_wall(row["report"]) == without_wall(alone)


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sigterm_stops_the_sweep_and_its_workers(jobs: str, tmp_path: Path) -> None:
    """Mid-run, SIGTERM ends the sweep as it ends kvpool simulate (143, one line), writes
    no table and leaves no worker process behind; inline, the pool actor's crash on the
    interrupt is the interrupt, not a failed run."""
    table = tmp_path / "t.json"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "sweep", "--grid", "sessions=400,401,402",
         "--jobs", jobs, "--json", str(table)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert sweep.stderr is not None
    try:
        assert "at a time" in sweep.stderr.readline()
        time.sleep(0.5)  # into the first runs
        children = Path(f"/proc/{sweep.pid}/task/{sweep.pid}/children").read_text().split()
        sweep.send_signal(signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
    finally:
        sweep.kill()
    assert sweep.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kvpool sweep: terminated (SIGTERM)"
    assert not table.exists()
    # the workers are gone; multiprocessing's resource tracker ends on its own pipe's EOF
    deadline = time.monotonic() + 30
    while [pid for pid in children if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, f"left running: {children}"
        time.sleep(0.05)
