"""Fidelity benchmark: kvpool beside Dynamo's offline replay under memory pressure.

Reproduce (from the repository root; Dynamo's side needs ``ai-dynamo-runtime``, in the
test extra, Linux only; without it kvpool's side is printed alone):

    python benchmarks/bench_fidelity.py                      # the four cases, two timings
    python benchmarks/bench_fidelity.py --multiturn synth.jsonl

The four pressure cases (LIFO, block size 16, 256 sequences, an 8,192-token budget, one
worker, vLLM 0.33's admission: the whole prompt must fit):

- kvpool's sample trace (``kvpool/data/sample_trace.jsonl``, 300 requests), 1,024 blocks,
  prefix caching on and off;
- the multi-turn trace ``../shared/bench/gen_multiturn_trace.py --sessions 3000
  --session-rate 1.0`` writes (8,957 requests), 4,096 blocks, prefix caching on and off.

Each runs on two step-time models, as ai-dynamo-runtime 1.6.1 (the test extra's)
charges a step (``kvpool simulate --timing-model dynamo-1.6``; `kvpool.engine.timing`
says how it differs from 1.4.0's ``dynamo``):

- ``polynomial``: Dynamo's default (`Dynamo16Timing`);
- ``profile``: interpolated from a planner-profile NPZ this script writes
  (`Dynamo16ProfileTiming`; ``--planner-profile-data``). 1.6.1's offline replay takes
  no NPZ (its ``timing_model`` is polynomial, fixed or external), so its side runs its
  ``fixed`` model, which a profile with flat tables (`FLAT_PROFILE_MS`) is: both charge
  a fixed prefill time in a step that computes prompt tokens and a fixed decode time in a
  step in which a request decodes.

For each it prints Dynamo's and kvpool's preemptions (Dynamo: re-admissions), prefix
hit tokens summed over admissions, and the requests whose TTFT agrees within 1 ms (and
the largest difference), matching requests by arrival time and lengths. Target (issue "The engine
under memory pressure"): Dynamo's preemption counts and at least 99% of requests with
the same TTFT in all four cases.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from bench_engine import GENERATOR, MULTITURN_ARGS, multiturn_trace
from build_info import REPO, describe_build

from kvpool.engine import EngineConfig
from kvpool.engine.runner import run_simulation
from kvpool.engine.timing import Dynamo16ProfileTiming, Dynamo16Timing, StepTiming
from kvpool.workloads import MooncakeTrace

SAMPLE = REPO / "kvpool" / "data" / "sample_trace.jsonl"
SAMPLE_BLOCKS = 1024
MULTITURN_BLOCKS = 4096
TTFT_TOLERANCE_MS = 1.0
TARGET_SAME_TTFT = 0.99
FLAT_PROFILE_MS = (31.25, 7.8125)
"""(prefill, decode) milliseconds of the flat planner profile and of Dynamo's ``fixed``
model beside it: powers of two in seconds, so that kvpool's clock (seconds) and Dynamo's
(milliseconds) both sum them exactly, and an arrival (whole milliseconds) that ties with
a step's end ties in both (with 25 and 8 ms, 0.008 s rounds, and kvpool's clock reaches
such an arrival a hair early or late: one step apart for 6% of the multi-turn trace)."""


@dataclass(frozen=True)
class Side:
    """One simulator's run of one case: its requests as (arrival ms after the first
    arrival, prompt tokens, output tokens) with their TTFT in ms, and totals."""

    ttft_ms: dict[tuple[float, int, int], float]
    preemptions: int
    hit_tokens: int
    wall_s: float


def write_profile(path: Path) -> Path:
    """A flat planner profile (`FLAT_PROFILE_MS` everywhere), as Dynamo's profiler
    writes one: the five arrays `ProfileTiming.from_npz` reads."""
    import numpy as np

    prefill_ms, decode_ms = FLAT_PROFILE_MS
    isl = np.array([0.0, 8192.0, 65536.0])
    kv = np.array([0.0, 16384.0, 1 << 20])
    ctx = np.array([0.0, 8192.0, 131072.0])
    np.savez(
        path,
        prefill_isl=isl,
        prefill_ttft_ms=np.full(isl.shape, prefill_ms),
        decode_active_kv_tokens=kv,
        decode_context_length=ctx,
        decode_itl=np.full((kv.size, ctx.size), decode_ms),
    )
    return path


def kvpool_side(path: Path, config: EngineConfig) -> Side:
    """kvpool's run of the trace (local backend, fast-forward): its records by line."""
    with MooncakeTrace(path) as trace:
        requests = list(trace)
    start = time.perf_counter()
    run = anyio.run(run_simulation, requests, config)
    wall = time.perf_counter() - start
    stats = run.engines[0].stats
    first = requests[0].arrival_s
    ttft: dict[tuple[float, int, int], float] = {}
    for record in stats.requests:
        assert record.first_token_s is not None, record
        key = (
            round((record.arrival_s - first) * 1e3, 3),
            record.prompt_tokens,
            record.output_tokens,
        )
        ttft[key] = (record.first_token_s - record.arrival_s) * 1e3
    if len(ttft) != len(requests):
        raise SystemExit(f"{path}: two requests arrive together with equal lengths")
    return Side(ttft, stats.preemptions, stats.prefix_hit_tokens, wall)


def dynamo_side(path: Path, config: EngineConfig, timing: str) -> Side | None:
    """Dynamo's offline replay of the trace with ``config``'s cache and limits and its
    ``timing`` model; None without ai-dynamo-runtime."""
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo._core import run_mocker_trace_replay
    except ImportError:
        return None
    engine: dict[str, Any] = {
        "num_gpu_blocks": config.num_gpu_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "preemption_mode": config.preemption_mode,
    }
    if timing == "polynomial":
        engine["timing_model"] = {"type": "polynomial"}
    else:
        prefill_ms, decode_ms = FLAT_PROFILE_MS
        engine["timing_model"] = {"type": "fixed", "prefill_ms": prefill_ms, "decode_ms": decode_ms}
    start = time.perf_counter()
    result = run_mocker_trace_replay(
        [str(path)],
        extra_engine_args={"engine": engine},
        trace_block_size=512,
        capture_per_request=True,
    )
    wall = time.perf_counter() - start
    ttft: dict[tuple[float, int, int], float] = {}
    preemptions = hits = 0
    for row in result.per_request:  # its arrival times start at 0
        key = (round(row["arrival_time_ms"], 3), row["input_length"], row["output_length"])
        ttft[key] = float(row["ttft_ms"])
        preemptions += int(row["readmission_count"])
        hits += sum(int(a["reused_input_tokens"]) for a in row["admission_history"])
    return Side(ttft, preemptions, hits, wall)


def case_row(label: str, ours: Side, theirs: Side | None) -> bool:
    """Print one case; True if it meets the target (or Dynamo is not installed)."""
    if theirs is None:
        print(
            f"  {label:44s} {'-':>7s}/{ours.preemptions:<7,d} {'-':>10s}/{ours.hit_tokens:<10,d}"
            f" {'(Dynamo not installed)':>22s}   kvpool {ours.wall_s:.2f} s"
        )
        return True
    if theirs.ttft_ms.keys() != ours.ttft_ms.keys():
        raise SystemExit(f"{label}: the two runs read the trace's requests differently")
    diffs = [abs(ttft - theirs.ttft_ms[key]) for key, ttft in ours.ttft_ms.items()]
    same = sum(d <= TTFT_TOLERANCE_MS for d in diffs)
    n = len(diffs)
    met = theirs.preemptions == ours.preemptions and same >= TARGET_SAME_TTFT * n
    print(
        f"  {label:44s} {theirs.preemptions:>7,d}/{ours.preemptions:<7,d} "
        f"{theirs.hit_tokens:>10,d}/{ours.hit_tokens:<10,d} "
        f"{same:>6,d} of {n:<6,d} ({100 * same / n:5.1f}%)  max {max(diffs):9.3f} ms  "
        f"{'met' if met else 'NOT met'}   wall {theirs.wall_s:.2f} / {ours.wall_s:.2f} s"
    )
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--multiturn",
        type=Path,
        metavar="PATH",
        help=f"the multi-turn trace (default: generated with {GENERATOR.name} "
        f"{' '.join(MULTITURN_ARGS)})",
    )
    parser.add_argument(
        "--timing", choices=("polynomial", "profile", "both"), default="both", help="step times"
    )
    parser.add_argument(
        "--no-scheduler-reserve-full-isl",
        dest="full_isl",
        action="store_false",
        help="kvpool admits when this step's chunk fits (the rule before vLLM 0.33's)",
    )
    args = parser.parse_args()
    print(describe_build())
    with tempfile.TemporaryDirectory(prefix="bench_fidelity_") as workdir:
        npz = write_profile(Path(workdir) / "flat_profile.npz")
        profile = Dynamo16ProfileTiming.from_npz(npz)
        traces = [("sample trace", SAMPLE, SAMPLE_BLOCKS)]
        multiturn = multiturn_trace(args.multiturn, Path(workdir))
        if multiturn is not None:
            traces.append(("multi-turn trace", multiturn, MULTITURN_BLOCKS))
        timings: list[tuple[str, StepTiming]] = []
        if args.timing in ("polynomial", "both"):
            timings.append(("polynomial", Dynamo16Timing()))
        if args.timing in ("profile", "both"):
            timings.append(("profile", profile))
        all_met = compared = True
        for timing_name, timing in timings:
            what = (
                "Dynamo's polynomial"
                if timing_name == "polynomial"
                else f"flat planner profile {FLAT_PROFILE_MS} ms (Dynamo: fixed)"
            )
            print(f"\ntiming: {what}; LIFO, block 16, 256 seqs, 8,192-token budget")
            print(
                f"  {'case':44s} {'preemptions':>15s} {'hit tokens':>21s} "
                f"{'same TTFT (<= 1 ms)':>22s}  Dynamo / kvpool"
            )
            for name, path, blocks in traces:
                for caching in (True, False):
                    config = EngineConfig(
                        num_gpu_blocks=blocks,
                        enable_prefix_caching=caching,
                        enable_kv_cache_events=False,
                        scheduler_reserve_full_isl=args.full_isl,
                        timing=timing,
                    )
                    label = f"{name}, {blocks:,} blocks" + ("" if caching else ", no caching")
                    ours = kvpool_side(path, config)
                    theirs = dynamo_side(path, config, timing_name)
                    all_met = case_row(label, ours, theirs) and all_met
                    compared = compared and theirs is not None
        print(
            f"\ntarget (Dynamo's preemptions, >= 99% same TTFT, every case): "
            f"{('met' if all_met else 'NOT met') if compared else 'not checked (no Dynamo)'}"
        )


if __name__ == "__main__":
    main()
