"""Every benchmark still runs: each is started for real, in its smallest configuration,
and must exit cleanly and print its headline figures. Nothing here asserts a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# the traces the benchmarks quote live in ../shared, which CI lacks: the repository's
# sample trace stands in for them, to run their code
SAMPLE = str(BENCHMARKS.parent / "kvpool" / "data" / "sample_trace.jsonl")

RUNS = {
    "routing": (
        ["bench_routing.py", "--trace", SAMPLE, "--num-gpu-blocks", "2048", "--no-dynamo"],
        ["round-robin", "llm-d", "prefix_router:make", "cached tokens", "round robin's"],
    ),
    "pool": (["bench_pool.py", "--quick"], ["ns/call", "memory per resident cached block"]),
    "actor": (["bench_actor.py", "--quick"], ["Round trip", "minimal actor", "x bare"]),
    "engine": (
        ["bench_engine.py", "--repeat", "1", "--no-profile"],
        ["wall time", "direct turns", "inside pool actor turns"],
    ),
    "engine-traces": (
        [
            *("bench_engine.py", "--no-embedded", "--repeat", "1"),
            *("--multiturn", SAMPLE, "--mooncake", SAMPLE),
        ],
        [
            *("fast-forward", "step by step", "steps simulated", "KV calls", "ms/request"),
            "answered from a recording, same totals",
            "per request (steps",
            *("16384", "in the model", "database queries"),
        ],
    ),
    "events": (["bench_events.py"], ["tokens", "batches"]),
    "event-identity": (["bench_event_identity.py", "--requests", "40"], ["digest"]),
    "event-identity-traces": (
        [
            *("bench_event_identity.py", "--requests", "10", "--traces", "--no-mooncake"),
            *("--multiturn", SAMPLE),
        ],
        ["digest", "sample_trace.jsonl 4096"],
    ),
    "fidelity": (
        ["bench_fidelity.py", "--multiturn", SAMPLE, "--timing", "polynomial"],
        ["preemptions", "hit tokens", "same TTFT", "target"],
    ),
    "report-identity": (
        [
            *("bench_report_identity.py", "--no-multiturn", "--no-mooncake", "--no-dynamo"),
            *("--kv-backend", "local"),
        ],
        ["sample trace", "this tree"],
    ),
    "memory": (
        ["bench_memory.py", "--trace", SAMPLE],
        ["peak RSS", "target < 500 MB", "the run's own wall time", "Dynamo mocker"],
    ),
    "memory-breakdown": (
        ["bench_memory.py", "--trace", SAMPLE, "--breakdown"],
        ["held at the end of the run", "building the report", "peak RSS of this process"],
    ),
    "sweep": (
        ["bench_sweep.py", "--quick"],
        ["sweep --jobs 2", "4 x kvpool simulate in turn", "reports identical across the three"],
    ),
    "fuzz": (["fuzz_actor.py", "--quick"], ["asyncio: seeds", "trio: seeds", "no breach"]),
    "serve": (
        ["bench_serve.py", "--requests", "20", "--max-tokens", "4"],
        [
            *("worst clock lag", "requests per second", "tokens per second", "leaked blocks 0"),
            *("worst engine clock lag", "small requests, refusing", "50,000-prompt batch"),
        ],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_benchmark_runs_and_prints_its_figures(name: str) -> None:
    arguments, expected = RUNS[name]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / arguments[0]), *arguments[1:]],
        capture_output=True,
        text=True,
        timeout=300,  # a guard against hangs, not a timing assertion
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for phrase in expected:
        assert phrase in done.stdout, (phrase, done.stdout[-2000:])
