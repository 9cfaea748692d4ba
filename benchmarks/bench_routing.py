"""Every router side by side on conversation traces, 4 workers, with Dynamo's kv_router.

For each trace: kvpool's round-robin, least-loaded, ``kv`` (Dynamo's KV router, events),
``kv`` in its approximate mode (``use_kv_events: false``), ``llm-d`` and the example
plug-in (``examples/prefix_router.py``), then Dynamo 1.6.1's own offline replay
(``run_mocker_trace_replay``, ``--num-workers 4``, ``router_mode`` round_robin and
kv_router, its default ``KvRouterConfig``) on the same trace and cache, its step times
the same polynomial (kvpool ``--timing-model dynamo-1.6``). Columns: prefix reuse (cached
over prompt tokens, Dynamo's ``prefix_cache_reused_ratio``), cached tokens and their
ratio to round robin's, TTFT mean and p99, the spread of requests over workers
(max/min), wall seconds. Then the issue's acceptance: ``kv`` reuse >= Dynamo kv_router's
- 0.005, mean TTFT <= 1.05x Dynamo's, >= 1.5x round robin's cached tokens.

    python benchmarks/bench_routing.py                 # multi-turn and Mooncake traces
    python benchmarks/bench_routing.py --trace T.jsonl --num-gpu-blocks 4096
    python benchmarks/bench_routing.py --no-dynamo

Traces: the multi-turn trace (``../shared/bench/gen_multiturn_trace.py --sessions 3000
--session-rate 1.0``, 4,096 blocks per worker) and Mooncake's conversation trace
(``../shared/traces/mooncake_synthetic_trace.jsonl.gz``, 131,072 blocks per worker, as
the issue measured); both are skipped when ``../shared`` is missing.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import anyio
from bench_engine import GENERATOR, MOONCAKE, multiturn_trace
from build_info import REPO

from kvpool.engine import Dispatch, EngineConfig, SimulationRun, run_simulation
from kvpool.engine.timing import Dynamo16Timing
from kvpool.routing import DispatchPolicy, RouterSettings, make_router
from kvpool.workloads import MooncakeTrace, TraceWarning

WORKERS = 4
POLICIES: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("round-robin", "round-robin", {}),
    ("least-loaded", "least-loaded", {}),
    ("kv", "kv", {}),
    ("kv, approximate (no events)", "kv", {"use_kv_events": False}),
    ("llm-d", "llm-d", {}),
    ("plug-in prefix_router:make", "prefix_router:make", {}),
)


@dataclass(frozen=True)
class Row:
    label: str
    reuse: float
    hits: int
    ttft_mean_ms: float
    ttft_p99_ms: float
    spread: float | None
    wall_s: float


def kvpool_row(label: str, name: str, options: dict[str, object], path: Path, blocks: int) -> Row:
    """One kvpool run of the trace with that dispatch."""
    config = EngineConfig(num_gpu_blocks=blocks, timing=Dynamo16Timing())
    dispatch: Dispatch | DispatchPolicy = name  # type: ignore[assignment]
    if name not in ("round-robin", "least-loaded"):
        settings = RouterSettings(WORKERS, config.block_size, seed=0, config=options)
        dispatch = make_router(name, settings)

    async def go() -> SimulationRun:
        with MooncakeTrace(path) as trace:
            return await run_simulation(
                trace,
                config,
                workers=WORKERS,
                dispatch=dispatch,
                router_name=name,
            )

    start = time.perf_counter()
    run = anyio.run(go)
    wall = time.perf_counter() - start
    report = run.report
    total = report.total
    requests = [w.requests_submitted for w in report.workers]
    return Row(
        label,
        total.prefix_cache_hits / total.prompt_tokens,
        total.prefix_cache_hits,
        1e3 * total.ttft_s.mean,
        1e3 * total.ttft_s.p99,
        max(requests) / min(requests) if min(requests) else None,
        wall,
    )


def dynamo_row(mode: str, path: Path, blocks: int) -> Row | None:
    """Dynamo's offline replay with ``mode`` (round_robin or kv_router); None without it."""
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo._core import run_mocker_trace_replay
        from dynamo.llm import KvRouterConfig
    except ImportError:
        return None
    config = EngineConfig(num_gpu_blocks=blocks)
    engine = {
        "num_gpu_blocks": blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "timing_model": {"type": "polynomial"},
    }
    start = time.perf_counter()
    result = run_mocker_trace_replay(
        [str(path)],
        extra_engine_args={"engine": engine},
        trace_block_size=512,
        num_workers=WORKERS,
        router_mode=mode,
        router_config=KvRouterConfig() if mode == "kv_router" else None,
    )
    wall = time.perf_counter() - start
    summary = result.summary
    reuse = float(summary["prefix_cache_reused_ratio"])
    prompt = sum(row["input_length"] for row in _rows(path))
    return Row(
        f"Dynamo 1.6.1 {mode}",
        reuse,
        round(reuse * prompt),
        float(summary["mean_ttft_ms"]),
        float(summary["p99_ttft_ms"]),
        None,
        wall,
    )


def _rows(path: Path) -> list[dict[str, int]]:
    import json

    with path.open() as file:
        return [json.loads(line) for line in file if line.strip()]


def show(rows: list[Row], baseline: Row) -> None:
    print(
        f"  {'router':30s} {'reuse':>7s} {'cached tokens':>14s} {'x RR':>6s} "
        f"{'TTFT mean':>10s} {'TTFT p99':>10s} {'spread':>7s} {'wall':>8s}"
    )
    for row in rows:
        spread = "-" if row.spread is None else f"{row.spread:.2f}x"
        print(
            f"  {row.label:30s} {row.reuse:7.4f} {row.hits:14,} {row.hits / baseline.hits:5.2f}x "
            f"{row.ttft_mean_ms:8.1f}ms {row.ttft_p99_ms:8.1f}ms {spread:>7s} {row.wall_s:7.1f}s"
        )


def acceptance(kv: Row, rr: Row, dynamo: Row | None) -> None:
    checks = [
        (
            f"cached tokens {kv.hits / rr.hits:.2f}x round robin's (>= 1.5x)",
            kv.hits >= 1.5 * rr.hits,
        )
    ]
    if dynamo is not None:
        checks.insert(
            0,
            (
                f"reuse {kv.reuse:.4f} vs Dynamo kv_router {dynamo.reuse:.4f} (>= -0.005)",
                kv.reuse >= dynamo.reuse - 0.005,
            ),
        )
        ratio = kv.ttft_mean_ms / dynamo.ttft_mean_ms
        checks.insert(1, (f"mean TTFT {ratio:.3f}x Dynamo kv_router's (<= 1.05x)", ratio <= 1.05))
    for text, ok in checks:
        print(f"  --dispatch kv: {text}: {'ok' if ok else 'NOT MET'}")


def bench(label: str, path: Path, blocks: int, dynamo: bool) -> None:
    print(
        f"\n{label}: {path} ({len(_rows(path)):,} requests), {WORKERS} workers of {blocks:,} blocks"
    )
    rows = [kvpool_row(lab, name, opts, path, blocks) for lab, name, opts in POLICIES]
    dynamo_rows = []
    if dynamo:
        for mode in ("round_robin", "kv_router"):
            row = dynamo_row(mode, path, blocks)
            if row is None:
                print("  Dynamo: skipped (pip install ai-dynamo-runtime, Linux, to compare)")
                break
            dynamo_rows.append(row)
    show(rows + dynamo_rows, rows[0])
    kv = next(row for row in rows if row.label == "kv")
    acceptance(kv, rows[0], dynamo_rows[-1] if len(dynamo_rows) == 2 else None)


def _plain(path: Path, workdir: Path) -> Path:
    """``path`` itself, or for a ``.gz`` trace a plain copy in ``workdir`` (Dynamo's
    replay, and the reuse figures' row count, read plain JSONL)."""
    if path.suffix != ".gz":
        return path
    plain = workdir / path.with_suffix("").name
    with gzip.open(path, "rb") as source, plain.open("wb") as target:
        shutil.copyfileobj(source, target)
    return plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="only this Mooncake-format trace")
    parser.add_argument("--num-gpu-blocks", type=int, default=4096, help="with --trace")
    parser.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's replay")
    parser.add_argument("--multiturn", type=Path, help="a copy of the multi-turn trace")
    parser.add_argument("--mooncake", type=Path, default=MOONCAKE, help="Mooncake's trace")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "examples"))  # the plug-in example
    warnings.simplefilter("ignore", TraceWarning)  # the generator's short first blocks
    dynamo = not args.no_dynamo
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.trace is not None:
            bench("trace", _plain(args.trace, workdir), args.num_gpu_blocks, dynamo)
            return
        if args.multiturn is not None or GENERATOR.is_file():
            path = multiturn_trace(args.multiturn, workdir)
            assert path is not None
            bench("multi-turn trace", path, 4096, dynamo)
        else:
            print(f"multi-turn trace: skipped, no generator at {GENERATOR}")
        if args.mooncake.is_file():
            plain = _plain(args.mooncake, workdir)
            bench("Mooncake conversation trace", plain, 131072, dynamo)
        else:
            print(f"Mooncake trace: skipped, no {args.mooncake}")


if __name__ == "__main__":
    main()
