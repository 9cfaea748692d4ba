"""Memory benchmark: peak RSS of ``kvpool simulate`` on a long trace.

Reproduce the figures (from the repository root; the trace generator is in ``../shared``):

    python benchmarks/bench_memory.py --generate          # writes the trace, then runs it
    python benchmarks/bench_memory.py                     # runs the trace written before
    python benchmarks/bench_memory.py --no-fast-forward   # the step-by-step path
    python benchmarks/bench_memory.py --sessions 6700 --generate --breakdown
    python benchmarks/bench_memory.py --sessions 300 --generate --breakdown --tracemalloc

The trace is ``../shared/bench/gen_multiturn_trace.py --sessions 40000 --session-rate 1.0``
(119,773 requests): the multi-turn trace of ``bench_engine.py`` (3,000 sessions, 8,957
requests) with the same session rate and shapes, so the same load at every moment,
13 times as long (11 simulated hours); about ten times Mooncake's conversation trace.
It goes to the temporary directory (15 MB), not the repository.

The run is ``kvpool simulate --trace FILE --num-gpu-blocks 4096 --no-progress`` (any other
flag given here is passed on to it) in a child process; the figures are the child's peak
resident set size (``ru_maxrss`` from ``wait4``: the interpreter, the imports and the
whole run, report included), its wall time (startup and the trace's validation pass
included) and the run's own wall time from its JSON report, then (``--no-dynamo``
skips it) NVIDIA Dynamo's Rust replay of the same trace with the same cache and the
ratio of the two, as `bench_engine.py` prints it. Target: peak RSS under 500 MB
(10^6 bytes).

``--breakdown`` runs the same simulation in this process instead and prints what holds
the memory when the run ends (each `EngineStats` container: per-step samples, latency
samples, request records; deep sizes, per request and scaled to 120,000 requests) and what
building the report adds (`tracemalloc` around `build_report`); ``--tracemalloc`` traces
the whole run too and lists the largest allocation sites (several times slower: use a
smaller trace, e.g. ``--sessions 6700``, about 20,000 requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from build_info import REPO, describe_build  # benchmarks/ is the script's path

GENERATOR = REPO.parent / "shared" / "bench" / "gen_multiturn_trace.py"
SESSIONS = 40_000
SESSION_RATE = "1.0"
BLOCKS = 4096
TARGET_MB = 500
TARGET_REQUESTS = 120_000
MB = 1_000_000


def default_trace(sessions: int) -> Path:
    return Path(tempfile.gettempdir()) / f"kvpool_multiturn_{sessions}.jsonl"


def generate(path: Path, sessions: int) -> None:
    """Write the multi-turn trace of ``sessions`` sessions with the shared generator."""
    if not GENERATOR.is_file():
        raise SystemExit(f"bench_memory: no trace generator at {GENERATOR}")
    command = [
        sys.executable,
        str(GENERATOR),
        "--sessions",
        str(sessions),
        "--session-rate",
        SESSION_RATE,
        "--out",
        str(path),
    ]
    print("generating:", " ".join(command[1:]))
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    print(" ", done.stdout.strip())


def measure(trace: Path, blocks: int, extra: list[str], timeout: float, dynamo: bool) -> None:
    """Run ``kvpool simulate`` on ``trace`` in a child and print its peak RSS and times;
    with ``dynamo`` (and no flag passed on), Dynamo's replay of the same trace beside."""
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as workdir:
        report_path = Path(workdir) / "report.json"
        command = [
            sys.executable,
            "-m",
            "kvpool",
            "simulate",
            "--trace",
            str(trace),
            "--num-gpu-blocks",
            str(blocks),
            "--no-progress",
            "--json",
            str(report_path),
            *extra,
        ]
        shown = [word for word in command[3:] if word not in ("--json", str(report_path))]
        print("running: kvpool", " ".join(shown))
        with (
            open(Path(workdir) / "stdout", "wb") as out,
            open(Path(workdir) / "stderr", "wb") as err,
        ):
            start = time.perf_counter()
            child = subprocess.Popen(command, stdout=out, stderr=err)
            timer = threading.Timer(timeout, child.kill)
            timer.start()
            try:
                # wait4: this child's own usage (RUSAGE_CHILDREN would also count the
                # generator's, or any earlier child's)
                _, status, usage = os.wait4(child.pid, 0)
            finally:
                timer.cancel()
            wall = time.perf_counter() - start
        child.returncode = code = os.waitstatus_to_exitcode(status)
        if code != 0:
            tail = (Path(workdir) / "stderr").read_text(errors="replace")[-2000:]
            killed = f" (killed after the {timeout:.0f} s timeout)" if code < 0 else ""
            print(f"kvpool simulate exited with {code}{killed}\n{tail}")
        peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        met = "met" if peak < TARGET_MB * MB else "NOT met"
        print(f"  peak RSS                 {peak / MB:8.1f} MB  (target < {TARGET_MB} MB: {met})")
        print(f"  wall time                {wall:8.1f} s  (process: startup, validation, run)")
        print(f"  CPU time                 {usage.ru_utime + usage.ru_stime:8.1f} s")
        if code == 0:
            report = json.loads(report_path.read_bytes())
            total = report["total"]
            print(
                f"  the run's own wall time  {report['wall_s']:8.1f} s  "
                f"({total['requests_submitted']:,} requests, "
                f"{report['requests_per_wall_s']:,.0f} per wall second)"
            )
            print(
                f"  simulated {report['simulated_s']:,.0f} s, {total['steps']:,} steps, "
                f"{total['generated_tokens']:,} tokens generated, "
                f"preemptions {total['preemptions']}"
            )
            if dynamo:
                dynamo_row(trace, blocks, extra, report["wall_s"])


def dynamo_row(trace: Path, blocks: int, extra: list[str], wall_s: float) -> None:
    """Dynamo's replay of ``trace`` with the same cache (`bench_engine.dynamo_replay`),
    in this process, and how long kvpool's run takes beside it."""
    if extra:
        print(f"  Dynamo mocker: skipped (flags passed on: {' '.join(extra)})")
        return
    from bench_engine import dynamo_replay, plain_copy

    from kvpool.engine import EngineConfig

    try:
        with plain_copy(trace) as plain:  # Dynamo's replay reads plain JSON lines
            replayed = dynamo_replay(plain, EngineConfig(num_gpu_blocks=blocks), 1)
    except Exception as exc:  # its own checks refuse some traces: say so
        print(f"  Dynamo mocker: failed on this trace ({exc})")
        return
    if replayed is None:
        print("  Dynamo mocker: skipped (pip install ai-dynamo-runtime to compare)")
        return
    dynamo_s, completed = replayed
    print(
        f"  Dynamo mocker, offline   {dynamo_s:8.1f} s  ({completed:,} requests, its Rust "
        f"replay, same trace and cache; kvpool's run takes {wall_s / dynamo_s:.1f}x as long)"
    )


def deep_size(root: object) -> int:
    """Bytes of ``root`` and everything it refers to (each object once); types,
    modules and functions are not followed."""
    seen: set[int] = set()
    stack = [root]
    size = 0
    skip = (type, type(sys), type(deep_size))
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
        if not gc.is_tracked(obj) and hasattr(obj, "__struct_fields__"):
            # a msgspec Struct with gc=False: its fields are not gc referents
            stack.extend(getattr(obj, name) for name in obj.__struct_fields__)
    return size


def breakdown(
    trace_path: Path, blocks: int, fast_forward: bool, backend: str, trace_run: bool
) -> None:
    """Run the simulation in this process; print what holds the memory at its end and
    what building the report adds (`tracemalloc` around `build_report`; around the whole
    run too with ``trace_run``, for the allocation sites: several times slower)."""
    import anyio

    from kvpool.engine import EngineConfig
    from kvpool.engine import runner as runner_module
    from kvpool.engine.runner import KV_BACKENDS, SimulationRun, run_simulation
    from kvpool.workloads import MooncakeTrace

    print(
        f"\nbreakdown: {trace_path}, --num-gpu-blocks {blocks}, {backend} backend, "
        f"fast-forward {'on' if fast_forward else 'off'}"
        + (", the whole run under tracemalloc" if trace_run else "")
    )
    # (peak RSS before the report, after it; traced bytes when it started, traced peak)
    probe: list[int] = []
    build_report = runner_module.build_report  # type: ignore[attr-defined]

    def probed_build_report(*args: Any, **kwargs: Any) -> Any:
        # built twice (it only reads the engines): once for the RSS, not inflated by
        # tracemalloc's own bookkeeping, then traced, for its allocations
        rss_before = peak_rss(resource.RUSAGE_SELF)
        result = build_report(*args, **kwargs)
        rss_after = peak_rss(resource.RUSAGE_SELF)
        tracing = tracemalloc.is_tracing()
        if not tracing:
            tracemalloc.start()
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        build_report(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
        if not tracing:
            tracemalloc.stop()
        probe.extend((rss_before, rss_after, held, peak))
        return result

    if trace_run:
        tracemalloc.start()
    with MooncakeTrace(trace_path) as trace:

        async def go() -> SimulationRun:
            return await run_simulation(
                trace,
                # as kvpool simulate --trace runs it: nothing to publish to, no event built
                EngineConfig(num_gpu_blocks=blocks, enable_kv_cache_events=False),
                kv_factory=KV_BACKENDS[backend],
                fast_forward=fast_forward,
            )

        runner_module.build_report = probed_build_report  # type: ignore[attr-defined]
        try:
            start = time.perf_counter()
            run = anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})
            wall = time.perf_counter() - start
        finally:
            runner_module.build_report = build_report  # type: ignore[attr-defined]
    snapshot = tracemalloc.take_snapshot() if trace_run else None
    tracemalloc.stop()

    total = run.report.total
    requests = total.requests_submitted
    scale = TARGET_REQUESTS / requests
    print(
        f"  {requests:,} requests, {total.steps:,} steps, {total.generated_tokens:,} tokens "
        f"generated, {wall:.0f} s; x{scale:.1f} below is at {TARGET_REQUESTS:,} requests"
    )
    rss_before, rss_after, held, peak = probe
    print(
        f"  peak RSS of this process: {rss_before / MB:.1f} MB before the report, "
        f"{rss_after / MB:.1f} MB after building it"
    )
    print(
        f"  building the report allocates up to {(peak - held) / MB:.1f} MB more than the run "
        f"holds (x{scale:.1f}: {(peak - held) * scale / MB:.0f} MB)"
    )
    print("  held at the end of the run by the engines' stats (deep sizes):")
    for name, size in stats_sizes(run):
        print(
            f"    {name:16s} {size / MB:8.1f} MB {size / requests:9.0f} B/request "
            f"(x{scale:.1f}: {size * scale / MB:5.0f} MB)"
        )
    if snapshot is not None:
        print("  largest allocation sites held at the end (tracemalloc, by line):")
        for stat in snapshot.statistics("lineno")[:12]:
            frame = stat.traceback[0]
            where = frame.filename
            if "/kvpool/" in where:
                where = os.path.relpath(where, REPO)
            print(f"    {stat.size / MB:8.1f} MB {stat.count:10,d} blocks  {where}:{frame.lineno}")


def peak_rss(who: int) -> int:
    """Peak resident set size in bytes of this process or its children so far."""
    return resource.getrusage(who).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def stats_sizes(run: Any) -> Iterator[tuple[str, int]]:
    """Deep sizes of the `EngineStats` fields that grow with the run (its containers:
    samples and records), each summed over the engines; then the report's."""
    first = run.engines[0].stats
    for field in dataclasses.fields(first):
        if isinstance(getattr(first, field.name), list | dict | array):
            yield field.name, sum(deep_size(getattr(e.stats, field.name)) for e in run.engines)
    yield "(the report)", deep_size(run.report)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other flags are passed on to kvpool simulate.",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help=f"the trace (default: {default_trace(SESSIONS)}, or for --sessions N "
        "kvpool_multiturn_N.jsonl there)",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help=f"write the trace first with {GENERATOR} --sessions N --session-rate {SESSION_RATE}",
    )
    parser.add_argument(
        "--sessions",
        type=int,
        default=SESSIONS,
        help=f"sessions of the generated trace (default {SESSIONS}: ~120,000 requests)",
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=BLOCKS, metavar="N")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds (default 1800)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="instead of the RSS run: run in this process and print what holds the "
        "memory at its end and what building the report adds",
    )
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="with --breakdown: trace the whole run, for the allocation sites (slower)",
    )
    parser.add_argument(
        "--no-dynamo",
        dest="dynamo",
        action="store_false",
        help="skip Dynamo's replay of the trace beside the run",
    )
    args, extra = parser.parse_known_args()
    print(describe_build(compiled=False))
    trace: Path = args.trace or default_trace(args.sessions)
    if args.generate:
        generate(trace, args.sessions)
    if not trace.is_file():
        raise SystemExit(f"bench_memory: no trace at {trace} (--generate writes it)")
    if args.breakdown:
        known = argparse.ArgumentParser(add_help=False)
        known.add_argument("--fast-forward", action=argparse.BooleanOptionalAction, default=True)
        known.add_argument("--kv-backend", default="actor")
        flags, rest = known.parse_known_args(extra)
        if rest:
            parser.error(f"--breakdown takes only --[no-]fast-forward, --kv-backend: {rest}")
        breakdown(
            trace, args.num_gpu_blocks, flags.fast_forward, flags.kv_backend, args.tracemalloc
        )
        return
    measure(trace, args.num_gpu_blocks, extra, args.timeout, args.dynamo)


if __name__ == "__main__":
    main()
