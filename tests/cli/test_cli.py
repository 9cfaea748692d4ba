"""``kvpool simulate`` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cli_runs import ROOT, kvpool

from kvpool import cli
from kvpool.events import decode_batch
from kvpool.flags.engine import engine_config
from kvpool.workloads import SyntheticWorkload, read_mooncake_trace

SAMPLE_TRACE = ROOT / "kvpool" / "data" / "sample_trace.jsonl"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_consistent(report: dict[str, Any], submitted: int, workers: int) -> None:
    """The report's numbers agree with each other and with the workload."""
    total = report["total"]
    assert total["requests_submitted"] == submitted
    assert total["requests_completed"] + total["requests_rejected"] == submitted
    assert len(report["workers"]) == workers
    columns = [*report["workers"], total]
    for column in columns:
        assert (
            column["requests_completed"] + column["requests_rejected"]
            == (column["requests_submitted"])
        )
        assert 0 <= column["prefix_cache_hits"] <= column["prefix_cache_queries"]
        assert column["leaked_blocks"] == 0
        usage = column["kv_usage"]
        assert 0 <= usage["p50"] <= usage["p90"] <= usage["p99"] <= usage["max"] <= 1
        assert usage["mean"] <= usage["max"]
    for key in (
        "requests_submitted",
        "requests_completed",
        "requests_rejected",
        "prompt_tokens",
        "generated_tokens",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "preemptions",
        "evictions",
        "steps",
    ):
        assert total[key] == sum(worker[key] for worker in report["workers"]), key
    assert report["simulated_s"] == max(worker["simulated_s"] for worker in report["workers"])


def test_the_embedded_default_runs_under_pressure_and_reports_consistently() -> None:
    result = kvpool("simulate", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    check_consistent(report, len(SyntheticWorkload().requests()), workers=1)
    total = report["total"]
    # the default flags promise real pressure on the cache
    assert total["preemptions"] > 0
    assert total["evictions"] > 0
    assert total["kv_usage"]["max"] == 1.0
    assert total["prefix_cache_hit_rate"] > 0.2
    assert "prefix cache hit rate" in result.stderr  # the text report moved to stderr
    assert "\r[" not in result.stderr  # no progress bar when stderr is not a terminal


def test_the_shipped_trace_runs_on_two_workers(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = kvpool(
        "simulate",
        "--trace",
        str(SAMPLE_TRACE),
        "--workers",
        "2",
        "--dispatch",
        "round-robin",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    submitted = len(read_mooncake_trace(SAMPLE_TRACE))
    check_consistent(report, submitted, workers=2)
    per_worker = [w["requests_submitted"] for w in report["workers"]]
    assert abs(per_worker[0] - per_worker[1]) <= 1  # round robin
    assert report["total"]["prefix_cache_hits"] > 0
    assert report["settings"]["workers"] == 2
    assert "worker 1" in result.stdout  # the text report went to stdout


def test_data_parallel_size_is_an_alias_of_workers() -> None:
    result = kvpool("simulate", "--sessions", "8", "--data-parallel-size", "3", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    check_consistent(report, len(SyntheticWorkload(num_sessions=8).requests()), workers=3)


def test_a_request_larger_than_the_pool_is_counted_as_rejected() -> None:
    result = kvpool("simulate", "--sessions", "10", "--num-gpu-blocks", "100", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    requests = SyntheticWorkload(num_sessions=10).requests()
    too_big = sum(1 for r in requests if -(-(r.input_length + r.output_length - 1) // 16) > 100)
    assert too_big > 0
    assert report["total"]["requests_rejected"] == too_big
    check_consistent(report, len(requests), workers=1)


def one_request_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "one.jsonl"
    trace.write_text(SAMPLE_TRACE.read_text().splitlines()[0] + "\n")
    return trace


@pytest.mark.parametrize(
    ("flags", "num_idle"),
    [
        (["--sessions", "1", "--workers", "2"], 1),  # one session's turns never overlap
        (["--sessions", "2", "--workers", "32"], 28),
        (["--sessions", "2", "--num-gpu-blocks", "2"], 0),  # every request rejected
        (["--trace", "ONE", "--workers", "3"], 2),
    ],
)
def test_idle_or_all_rejected_workers_report_zeros(
    tmp_path: Path, flags: list[str], num_idle: int
) -> None:
    flags = [str(one_request_trace(tmp_path)) if f == "ONE" else f for f in flags]
    result = kvpool("simulate", *flags, "--json", "-")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    total = report["total"]
    check_consistent(report, total["requests_submitted"], workers=len(report["workers"]))
    idle = [w for w in report["workers"] if w["requests_submitted"] == 0]
    assert len(idle) >= num_idle
    for worker in idle:
        assert worker["steps"] == worker["generated_tokens"] == 0
        assert set(worker["kv_usage"].values()) == {0.0}
        assert worker["ttft_s"]["p99"] == worker["latency_s"]["max"] == 0.0
        assert worker["prefix_cache_hit_rate"] is None  # nothing was asked
    if "--num-gpu-blocks" in flags:
        assert total["requests_rejected"] == total["requests_submitted"] > 0
        assert total["steps"] == total["generated_tokens"] == 0
        assert total["kv_usage"]["max"] == 0.0


@pytest.mark.slow
def test_the_plot_is_a_png(tmp_path: Path) -> None:
    image = tmp_path / "usage.png"
    result = kvpool("simulate", "--sessions", "10", "--workers", "2", "--plot", str(image))
    assert result.returncode == 0, result.stderr
    data = image.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    import matplotlib.image

    pixels = matplotlib.image.imread(str(image))
    assert pixels.shape[0] > 100
    assert pixels.shape[1] > 100


def test_an_unknown_plot_format_is_refused_before_the_run(tmp_path: Path) -> None:
    image = tmp_path / "usage.foo"
    result = kvpool("simulate", "--sessions", "3", "--plot", str(image))
    assert result.returncode == 1
    assert "--plot: cannot draw a .foo file; use one of:" in result.stderr
    assert "png" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not image.exists()


def test_a_report_file_that_cannot_be_written_is_a_clear_error() -> None:
    # /dev/full takes the open and fails the write (ENOSPC): after the run, not before
    result = kvpool("simulate", "--sessions", "3", "--json", "/dev/full")
    assert result.returncode == 1
    assert "kvpool simulate: error: --json: cannot write /dev/full" in result.stderr
    assert "Traceback" not in result.stderr
    assert "requests completed" in result.stdout  # the text report is not lost


def test_plot_without_matplotlib_is_a_clear_error_before_the_run(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib is hidden')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    image = tmp_path / "usage.png"
    result = kvpool("simulate", "--sessions", "3", "--plot", str(image), env=env)
    assert result.returncode == 1
    assert "--plot needs matplotlib" in result.stderr
    assert "pip install 'kvpool[plot]'" in result.stderr
    assert result.stdout == ""
    assert not image.exists()


@pytest.mark.parametrize("loop", ["trio", "uvloop"])
def test_a_missing_event_loop_is_a_clear_error(tmp_path: Path, loop: str) -> None:
    shadow = tmp_path / "shadow" / loop
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError('{loop} is hidden')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    result = kvpool("simulate", "--sessions", "3", "--loop", loop, env=env)
    assert result.returncode == 1
    assert f"--loop {loop}: {loop} is not installed" in result.stderr
    assert result.stdout == ""


def test_a_bad_trace_line_fails_before_anything_runs(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    good = SAMPLE_TRACE.read_text().splitlines()
    bad = '{"timestamp": 5, "input_length": -1, "output_length": 4, "hash_ids": []}'
    trace.write_text("\n".join([good[0], good[1], bad, *good[2:10]]))
    out = tmp_path / "report.json"
    result = kvpool("simulate", "--trace", str(trace), "--json", str(out))
    assert result.returncode == 1
    assert f"{trace}:3:" in result.stderr
    assert "input_length must be >= 1, got -1" in result.stderr
    assert result.stdout == ""
    assert not out.exists()


def test_an_unknown_field_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "extra.jsonl"
    line = json.loads(SAMPLE_TRACE.read_text().splitlines()[0])
    line["priority"] = 1
    trace.write_text(json.dumps(line) + "\n")
    result = kvpool("simulate", "--trace", str(trace))
    assert result.returncode == 1
    assert f"{trace}:1: bad record: Object contains unknown field `priority`" in result.stderr


def test_a_missing_trace_file_is_an_error(tmp_path: Path) -> None:
    result = kvpool("simulate", "--trace", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 1
    assert "cannot read the trace" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-gpu-blocks", "0"], "must be >= 1"),
        (["--block-size", "x"], "not an integer"),
        (["--speedup-ratio", "-1"], "must be a finite number >= 0"),
        (["--preemption-mode", "random"], "invalid choice"),
        (["--loop", "gevent"], "invalid choice"),
        # ZMQ would bind these modulo 65536 (70000 -> 4464) without a word
        # a flag that would be silently ignored is a mistake worth saying
        (["--trace", str(SAMPLE_TRACE), "--seed", "3"], "--trace replaces it"),
        (["--trace", str(SAMPLE_TRACE), "--sessions", "3"], "--trace replaces it"),
        (["--trace-block-size", "64"], "applies to a --trace only"),
        (["--zmq-kv-event-port", "70000"], "must be <= 65535"),
        (["--zmq-kv-event-port", "65535", "--workers", "2"], "port 65536, above 65535"),
        # absurd values: they would exhaust memory or the clock, not run
        (["--num-gpu-blocks", "100000000000"], "must be <= 4294967295"),
        (["--workers", "100000000"], "must be <= 10000"),
        (["--sessions", "100000000"], "must be <= 100000"),
        (["--step-overhead-ms", "1e308"], "must be <= 1e+06"),
        (["--prefill-us-per-token", "inf"], "must be a finite number >= 0"),
        (["--decode-us-per-seq", "nan"], "must be a finite number >= 0"),
        (["--speedup-ratio", "1e-300"], "must be 0 or >= 1e-06"),
    ],
)
def test_a_bad_flag_is_a_usage_error(flags: list[str], message: str) -> None:
    result = kvpool("simulate", *flags)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_help_documents_every_flag() -> None:
    result = kvpool("simulate", "--help")
    assert result.returncode == 0
    for flag in (
        "--trace",
        "--trace-block-size",
        "--seed",
        "--sessions",
        "--num-gpu-blocks",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--preemption-mode",
        "--scheduler-reserve-full-isl",
        "--no-scheduler-reserve-full-isl",
        "--watermark",
        "--step-overhead-ms",
        "--prefill-us-per-token",
        "--decode-us-per-seq",
        "--workers",
        "--data-parallel-size",
        "--dispatch",
        "--speedup-ratio",
        "--zmq-kv-event-port",
        "--zmq-kv-event-host",
        "--kv-backend",
        "--loop",
        "--json",
        "--plot",
        "--no-progress",
    ):
        assert flag in result.stdout, flag


def test_no_command_prints_usage() -> None:
    result = kvpool()
    assert result.returncode == 2
    assert "simulate" in result.stderr


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvpool"
    result = subprocess.run(
        [str(script), "simulate", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert "--num-gpu-blocks" in result.stdout


@pytest.mark.slow
def test_every_event_loop_and_kv_backend_gives_the_same_simulation() -> None:
    reports = []
    for loop, backend in (
        ("asyncio", "actor"),
        ("uvloop", "actor"),
        ("trio", "actor"),
        ("auto", "local"),
    ):
        result = kvpool(
            "simulate",
            "--sessions",
            "15",
            "--workers",
            "2",
            "--loop",
            loop,
            "--kv-backend",
            backend,
            "--json",
            "-",
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        for key in ("wall_s", "requests_per_wall_s", "settings"):
            del report[key]
        reports.append(report)
    assert reports[0] == reports[1] == reports[2] == reports[3]


def test_switches_change_the_simulation() -> None:
    def run(*flags: str) -> dict[str, Any]:
        result = kvpool("simulate", "--sessions", "20", "--json", "-", *flags)
        assert result.returncode == 0, result.stderr
        report: dict[str, Any] = json.loads(result.stdout)
        check_consistent(report, len(SyntheticWorkload(num_sessions=20).requests()), 1)
        total: dict[str, Any] = report["total"]
        return total

    no_caching = run("--no-enable-prefix-caching")
    assert no_caching["prefix_cache_queries"] == no_caching["prefix_cache_hits"] == 0
    assert no_caching["prefix_cache_hit_rate"] is None  # nothing asked: no rate, not 0%
    no_chunking = run("--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096")
    assert no_chunking["requests_completed"] > 0
    fifo = run("--preemption-mode", "fifo", "--num-gpu-blocks", "400")
    assert fifo["preemptions"] > 0


def free_port_pair() -> int:
    """A port P on loopback such that P and P + 1 were both free a moment ago."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free pair of ports")


@pytest.mark.slow
def test_kv_events_are_published_over_zmq_per_worker() -> None:
    import zmq

    port = free_port_pair()
    ctx = zmq.Context()
    subscribers = []
    try:
        for rank in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port + rank}")  # ZMQ retries until it binds
            subscribers.append(sub)
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpool",
                "simulate",
                "--sessions",
                "12",
                "--workers",
                "2",
                "--zmq-kv-event-port",
                str(port),
                "--zmq-kv-event-host",
                "127.0.0.1",
                "--json",
                "-",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        received: list[list[tuple[int, Any]]] = [[], []]
        poller = zmq.Poller()
        for sub in subscribers:
            poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = dict(poller.poll(100))
            for rank, sub in enumerate(subscribers):
                while sub in ready and sub.poll(0):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b""
                    received[rank].append((int.from_bytes(seq, "big"), decode_batch(payload)))
            if process.poll() is not None and not ready:
                break
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
    finally:
        for sub in subscribers:
            sub.close()
        ctx.term()
    assert f"publishing KV events on tcp://127.0.0.1:{port} (worker 0)" in stderr.decode()
    report = json.loads(stdout)
    for rank, batches in enumerate(received):
        assert batches, f"worker {rank} published nothing we saw"
        seqs = [seq for seq, _ in batches]
        # subscribed before the run, so at full speed too nothing is lost: 0, 1, 2, ...
        assert seqs == list(range(len(seqs)))
        assert all(batch.data_parallel_rank == rank for _, batch in batches)
        assert seqs[-1] + 1 == report["workers"][rank]["kv_event_batches"]
    # Without a publisher no event is built, and the report is the same, batches too.
    quiet = kvpool("simulate", "--sessions", "12", "--workers", "2", "--json", "-")
    assert quiet.returncode == 0, quiet.stderr
    quiet_report = json.loads(quiet.stdout)
    for either in (report, quiet_report):
        for key in ("wall_s", "requests_per_wall_s", "settings"):
            del either[key]
    assert quiet_report == report


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_kv_events_are_built_only_when_they_are_published(command: str) -> None:
    parser = cli.build_parser()
    quiet = parser.parse_args([command])
    publishing = parser.parse_args([command, "--zmq-kv-event-port", "5557"])
    assert not engine_config(quiet, parser).enable_kv_cache_events
    assert engine_config(publishing, parser).enable_kv_cache_events


@pytest.mark.parametrize(
    ("host", "endpoint"),
    [
        ("*", "tcp://*:5557"),
        ("127.0.0.1", "tcp://127.0.0.1:5557"),
        ("::1", "tcp://[::1]:5557"),
        ("[::1]", "tcp://[::1]:5557"),
    ],
)
def test_the_zmq_host_makes_an_endpoint_ipv6_included(host: str, endpoint: str) -> None:
    from kvpool.flags.events import zmq_endpoint

    assert zmq_endpoint(host, 5557) == endpoint


def test_a_busy_zmq_port_fails_before_anything_runs() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = kvpool(
            "simulate",
            "--sessions",
            "3",
            "--zmq-kv-event-port",
            str(port),
            "--zmq-kv-event-host",
            "127.0.0.1",
        )
    assert result.returncode == 1
    assert "--zmq-kv-event-port: Address already in use" in result.stderr
    assert result.stdout == ""


def test_a_progress_bar_is_drawn_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    try:
        result = kvpool("simulate", "--sessions", "10", stderr=terminal, timeout=120)
        os.close(terminal)
        terminal = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO once the terminal side is closed and drained
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert result.returncode == 0
    total = len(SyntheticWorkload(num_sessions=10).requests())
    assert b"\r[" in drawn
    assert f"{total}/{total} requests 100%".encode() in drawn
    quiet = kvpool("simulate", "--sessions", "10", "--no-progress", stderr=subprocess.PIPE)
    assert quiet.stderr == ""


def test_an_interrupted_run_exits_130_without_a_traceback() -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "simulate", "--speedup-ratio", "2"],
            stdout=subprocess.PIPE,
            stderr=terminal,
            cwd=ROOT,
        )
        seen = b""
        while b"requests" not in seen:  # the progress bar: the run has started
            seen += os.read(controller, 4096)
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=60)
        os.close(terminal)
        terminal = -1
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert process.returncode == 130
    assert b"kvpool simulate: interrupted" in seen
    assert b"Traceback" not in seen
    assert stdout == b""


def test_json_report_decodes_into_the_report_type() -> None:
    from kvpool.engine import Report

    result = kvpool("simulate", "--sessions", "5", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = msgspec.json.decode(result.stdout.encode(), type=Report)
    assert report.total.requests_submitted == len(SyntheticWorkload(num_sessions=5).requests())


# ------------------------------------------------------------------ latency figures, records


def test_the_report_carries_vllm_bench_serves_latencies(tmp_path: Path) -> None:
    records_path = tmp_path / "requests.jsonl"
    result = kvpool(
        "simulate",
        "--sessions",
        "10",
        "--workers",
        "2",
        "--num-gpu-blocks",
        "300",
        "--json",
        "-",
        "--requests-jsonl",
        str(records_path),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for column in [*report["workers"], report["total"]]:
        for name in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            d = column[name]
            assert 0 <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"], name
            assert d["mean"] <= d["max"]
        assert column["output_tokens_per_s"] == pytest.approx(
            column["generated_tokens"] / report["simulated_s"]
        )
    total = report["total"]
    assert total["ttft_s"]["p50"] <= total["latency_s"]["p50"]
    for row in ("TTFT p90 (ms)", "TPOT mean (ms)", "ITL p99 (ms)", "end-to-end latency p50"):
        assert row in result.stderr
    assert "output tokens per second" in result.stderr

    lines = records_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    requests = SyntheticWorkload(num_sessions=10).requests()
    assert len(records) == len(requests) == total["requests_submitted"]
    assert sorted(r["request_id"] for r in records) == sorted(r.request_id for r in requests)
    assert [r["arrival_s"] for r in records] == sorted(r["arrival_s"] for r in records)
    assert set(records[0]) == {
        "request_id",
        "worker",
        "arrival_s",
        "first_scheduled_s",
        "first_token_s",
        "finish_s",
        "prompt_tokens",
        "output_tokens",
        "cached_tokens",
        "preemptions",
        "rejected",
    }
    for worker in report["workers"]:
        mine = [r for r in records if r["worker"] == worker["worker"]]
        assert len(mine) == worker["requests_submitted"]
        assert sum(r["cached_tokens"] for r in mine) == worker["prefix_cache_hits"]
        assert sum(r["preemptions"] for r in mine) == worker["preemptions"]
        assert sum(r["rejected"] for r in mine) == worker["requests_rejected"]
    finished = [r for r in records if not r["rejected"]]
    assert total["generated_tokens"] == sum(r["output_tokens"] for r in finished)
    for r in finished:
        assert r["arrival_s"] <= r["first_scheduled_s"] < r["first_token_s"] <= r["finish_s"]
    assert total["latency_s"]["max"] == pytest.approx(
        max(r["finish_s"] - r["arrival_s"] for r in finished)
    )


def test_requests_jsonl_to_stdout_moves_the_text_report_to_stderr() -> None:
    result = kvpool("simulate", "--sessions", "3", "--requests-jsonl", "-")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == len(SyntheticWorkload(num_sessions=3).requests())
    assert "requests completed" in result.stderr
    both = kvpool("simulate", "--sessions", "3", "--requests-jsonl", "-", "--json", "-")
    assert both.returncode == 2
    assert "cannot both write to stdout" in both.stderr


# ------------------------------------------------------------------ no crash on any input


def test_version() -> None:
    from kvpool import __version__

    result = kvpool("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvpool {__version__}"


def totals_without_timing(stdout: str) -> dict[str, Any]:
    report = json.loads(stdout)
    total: dict[str, Any] = report["total"]
    return total


@pytest.mark.slow
def test_a_trace_on_stdin_or_gzipped_runs_as_the_file_does(tmp_path: Path) -> None:
    plain = kvpool("simulate", "--trace", str(SAMPLE_TRACE), "--json", "-")
    assert plain.returncode == 0, plain.stderr
    packed = tmp_path / "trace.jsonl.gz"
    packed.write_bytes(gzip.compress(SAMPLE_TRACE.read_bytes()))
    gz = kvpool("simulate", "--trace", str(packed), "--json", "-")
    assert gz.returncode == 0, gz.stderr
    with SAMPLE_TRACE.open("rb") as stdin:
        piped = kvpool("simulate", "--trace", "-", "--json", "-", stdin=stdin)
    assert piped.returncode == 0, piped.stderr
    assert "trace <stdin> (" in piped.stderr
    expected = totals_without_timing(plain.stdout)
    assert totals_without_timing(gz.stdout) == expected
    assert totals_without_timing(piped.stdout) == expected


def test_a_bad_line_on_stdin_is_named(tmp_path: Path) -> None:
    good = SAMPLE_TRACE.read_text().splitlines()
    line = json.loads(good[0])
    line["input_length"] = 2**40
    text = "\n".join([good[0], json.dumps(line)]) + "\n"
    result = kvpool("simulate", "--trace", "-", input=text)
    assert result.returncode == 1
    assert "<stdin>:2: input_length must be <= 2**30 tokens" in result.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1e300", "timestamp must be <= 1e+12 ms"),
        ("1e999", "Number out of range"),
        ("NaN", "not a JSON object"),
        ("-5", "timestamp must be >= 0 ms"),
    ],
)
def test_an_absurd_timestamp_is_a_one_line_error_and_nothing_runs(
    tmp_path: Path, value: str, message: str
) -> None:
    good = SAMPLE_TRACE.read_text().splitlines()
    bad = json.loads(good[3])
    bad["timestamp"] = 0
    trace = tmp_path / "absurd.jsonl"
    trace.write_text("\n".join([*good[:3], json.dumps(bad).replace(": 0,", f": {value},", 1)]))
    out = tmp_path / "requests.jsonl"
    result = kvpool("simulate", "--trace", str(trace), "--requests-jsonl", str(out))
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"kvpool simulate: error: {trace}:4: ")
    assert message in line
    assert result.stdout == ""
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--json", "--plot", "--requests-jsonl"])
@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("DIR", "is a directory"),
        ("DIR/missing/out.png", "no such directory"),
        ("/proc/kvpool-out.png", "cannot write /proc/kvpool-out.png"),
        ("TRACE", "is the trace; writing it would destroy the input"),
    ],
)
def test_a_bad_output_path_fails_before_the_run(
    tmp_path: Path, flag: str, where: str, message: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(SAMPLE_TRACE.read_bytes())
    target = where.replace("DIR", str(tmp_path)).replace("TRACE", str(trace))
    result = kvpool("simulate", "--trace", str(trace), flag, target)
    assert result.returncode == 1
    assert f"kvpool simulate: error: {flag}: " in result.stderr
    assert message in result.stderr
    assert result.stdout == ""
    assert trace.read_bytes() == SAMPLE_TRACE.read_bytes()


def test_the_trace_is_refused_as_an_output_under_another_name(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(SAMPLE_TRACE.read_bytes())
    alias = tmp_path / "alias.jsonl"
    alias.symlink_to(trace)
    result = kvpool("simulate", "--trace", str(trace), "--json", str(alias))
    assert result.returncode == 1
    assert "is the trace" in result.stderr
    assert trace.read_bytes() == SAMPLE_TRACE.read_bytes()


def test_two_outputs_in_one_file_are_refused_and_no_file_is_left(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    result = kvpool("simulate", "--sessions", "3", "--json", str(out), "--requests-jsonl", str(out))
    assert result.returncode == 1
    assert f"--requests-jsonl: {out} is also the --json file" in result.stderr
    assert not out.exists()  # the probe of a new file leaves none behind


def test_a_closed_stdout_is_an_error_line_not_a_traceback() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "simulate", "--sessions", "40", "--requests-jsonl", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stdout is not None
    process.stdout.close()  # the reader leaves before anything is written
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1
    assert b"kvpool simulate: error: stdout was closed early" in stderr
    assert b"Traceback" not in stderr


def read_until(controller: int, needle: bytes, seen: bytes = b"") -> bytes:
    """Read the pty until ``needle`` shows (a bounded wait: 60 s)."""
    deadline = time.monotonic() + 60
    while needle not in seen:
        assert time.monotonic() < deadline, seen[-500:]
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            seen += os.read(controller, 4096)
    return seen


def drain(controller: int) -> bytes:
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO once the terminal side is closed and drained
            return seen
        if not chunk:
            return seen
        seen += chunk


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["auto", "asyncio", "trio"])
def test_sigterm_mid_run_exits_143_with_a_message(loop: str) -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "simulate", "--speedup-ratio", "2", "--loop", loop],
            stdout=subprocess.PIPE,
            stderr=terminal,
            cwd=ROOT,
        )
        seen = read_until(controller, b"requests")  # the progress bar: the run has started
        process.send_signal(signal.SIGTERM)
        stdout, _ = process.communicate(timeout=60)
        os.close(terminal)
        terminal = -1
        seen += drain(controller)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert process.returncode == 143
    assert b"kvpool simulate: terminated (SIGTERM)" in seen
    assert b"Traceback" not in seen
    assert stdout == b""


def test_ctrl_c_while_the_trace_is_read_exits_130() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "simulate", "--trace", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stdin is not None
    line = SAMPLE_TRACE.read_bytes().splitlines()[0] + b"\n"
    # 1 MiB cannot sit in a pipe's buffer: once written, kvpool is reading the trace
    process.stdin.write(line * (1 + (1 << 20) // len(line)))
    process.stdin.flush()
    process.send_signal(signal.SIGINT)  # stdin stays open: the read would never end
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.stdin.close()
    assert process.returncode == 130
    assert stderr.decode().strip() == "kvpool simulate: interrupted"
    assert stdout == b""


def test_ctrl_c_interrupts_a_run_started_with_sigint_ignored() -> None:
    # what a shell's background job (`cmd &`, `trap '' INT`) hands its children: the
    # command must install its own Ctrl-C handling, not inherit "ignore"
    def ignore_interrupts() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    process = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "simulate", "--trace", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=ignore_interrupts,
    )
    assert process.stdin is not None
    line = SAMPLE_TRACE.read_bytes().splitlines()[0] + b"\n"
    process.stdin.write(line * (1 + (1 << 20) // len(line)))  # it is reading the trace
    process.stdin.flush()
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.stdin.close()
    assert process.returncode == 130
    assert stderr.decode().strip() == "kvpool simulate: interrupted"


def test_ctrl_c_during_the_zmq_subscriber_wait_exits_130() -> None:
    port = free_port_pair()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpool",
            "simulate",
            "--zmq-kv-event-port",
            str(port),
            "--zmq-kv-event-host",
            "127.0.0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stderr is not None
    first = process.stderr.readline()  # printed just before the 0.5 s wait
    assert b"publishing KV events" in first
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert b"kvpool simulate: interrupted" in stderr
    assert b"Traceback" not in stderr
    assert stdout == b""


def test_the_progress_line_fits_the_terminal() -> None:
    controller, terminal = pty.openpty()
    columns = 44
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    try:
        result = kvpool("simulate", "--sessions", "10", stderr=terminal, env=env)
        os.close(terminal)
        terminal = -1
        drawn = drain(controller)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert result.returncode == 0
    total = len(SyntheticWorkload(num_sessions=10).requests())
    lines = drawn.replace(b"\r\n", b"\n").split(b"\n")[0].split(b"\r")[1:]
    assert lines
    assert all(len(line) == columns - 1 for line in lines)  # padded to the width, never over
    assert f"{total}/{total} requests 100%".encode() in lines[-1]


def test_a_trace_from_a_terminal_says_it_is_reading_stdin() -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "simulate", "--trace", "-"],
            stdin=terminal,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        assert process.stderr is not None
        assert b"reading the trace from stdin (Ctrl-D ends it)" in process.stderr.readline()
        os.write(controller, SAMPLE_TRACE.read_bytes().splitlines()[0] + b"\n\x04")
        stdout, _ = process.communicate(timeout=60)
    finally:
        os.close(terminal)
        os.close(controller)
    assert process.returncode == 0
    assert b"trace <stdin> (1 requests)" in stdout


@pytest.mark.slow
def test_simulate_replays_with_vllms_four_frames_and_paced_wall_clock_ts() -> None:
    """``--zmq-replay-port``: while a paced run publishes, a DEALER asking for sequence 0
    gets ``[b"", topic, seq, payload]`` per batch (vLLM 0.33.0's framing) and the end
    marker; paced, each batch's ``ts`` is wall-clock time (within the run's span)."""
    import zmq

    port = free_port_pair()
    replay_port = free_port_pair()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.rcvtimeo = 30_000
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = 10_000
    started = time.time()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpool",
            "simulate",
            "--sessions",
            "4",
            "--speedup-ratio",
            "20",
            "--zmq-kv-event-port",
            str(port),
            "--zmq-replay-port",
            str(replay_port),
            "--zmq-kv-event-host",
            "127.0.0.1",
            "--zmq-kv-event-topic",
            "kv@pod:8000@m",
            "--kv-event-format",
            "map",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        topic, seq, payload = sub.recv_multipart()  # the run is live and publishing
        assert topic == b"kv@pod:8000@m"
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = dealer.recv_multipart()
            assert len(frames) == 4
            delimiter, topic, seq, payload = frames
            assert delimiter == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b"kv@pod:8000@m"
            replayed.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        sub.close()
        dealer.close()
        ctx.term()
    finished = time.time()
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    assert replayed
    assert all(started <= batch.ts <= finished for _, batch in replayed)


def test_simulate_rejects_a_replay_port_without_an_event_port() -> None:
    result = kvpool("simulate", "--zmq-replay-port", "6000")
    assert result.returncode == 2
    assert "--zmq-replay-port needs --zmq-kv-event-port" in result.stderr
