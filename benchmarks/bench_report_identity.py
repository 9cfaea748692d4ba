"""Before/after check of a pool or manager change: identical reports, and the speed ratio.

Runs ``kvpool simulate`` (its CLI, in a subprocess, ``--no-progress``) on each trace with
this tree's code and, with ``--before DIR``, with another tree's (a checkout of the
commit to compare with, built as this one is: ``python setup.py build_ext --inplace`` or
``pip install -e .``, so that both run compiled or both interpreted). For each trace it
prints whether the text report, the ``--json`` report and the ``--requests-jsonl``
records are byte-identical (wall-time fields left out: they are the only ones that may
differ), the wall and CPU seconds of each tree's run (best of ``--repeat``), the
after/before ratio, and, with ``ai-dynamo-runtime`` installed, Dynamo's Rust mocker
replaying the same trace with the same cache (`bench_engine.dynamo_replay`).

    python benchmarks/bench_report_identity.py --before /tmp/base-tree
    python benchmarks/bench_report_identity.py --before /tmp/base-tree --multiturn mt.jsonl

Traces: the repository's sample trace (default flags), the multi-turn trace
(``../shared/bench/gen_multiturn_trace.py --sessions 3000 --session-rate 1.0``, generated
into a temporary directory unless ``--multiturn`` names a copy; ``--num-gpu-blocks
4096``; ``--no-multiturn`` skips it) and Mooncake's synthetic trace at 1,024 and 16,384
blocks (``--no-mooncake`` skips it): every trace `bench_engine` times. ``--kv-backend``
picks the backend (default: the CLI's, the actor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_engine import (
    GENERATOR,
    MOONCAKE,
    MOONCAKE_BLOCKS,
    MULTITURN_ARGS,
    MULTITURN_BLOCKS,
    dynamo_replay,
    plain_copy,
)
from build_info import REPO

from kvpool.engine import EngineConfig

SAMPLE = REPO / "kvpool" / "data" / "sample_trace.jsonl"
WALL_KEYS = ("wall_s", "requests_per_wall_s")


@dataclass(frozen=True)
class Run:
    """One ``kvpool simulate`` run: its outputs with wall-time fields dropped, its times."""

    text: str
    report: str
    records: bytes
    wall_s: float
    cpu_s: float


def simulate(tree: Path, trace: Path, flags: list[str], workdir: Path) -> Run:
    """``kvpool simulate`` of ``trace`` with ``tree``'s code first on the path (run from
    ``tree``: ``python -m`` puts the working directory ahead of ``PYTHONPATH``)."""
    report_path = workdir / "report.json"
    records_path = workdir / "requests.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [
        *(sys.executable, "-m", "kvpool", "simulate", "--trace", str(trace), *flags),
        *("--no-progress", "--json", str(report_path), "--requests-jsonl", str(records_path)),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"kvpool simulate failed in {tree}:\n{done.stderr[-2000:]}")
    report = json.loads(report_path.read_text())
    for key in WALL_KEYS:
        report.pop(key, None)
    text = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("wall time"))
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Run(text, json.dumps(report, sort_keys=True), records_path.read_bytes(), wall, cpu)


def best(tree: Path, trace: Path, flags: list[str], repeat: int, workdir: Path) -> Run:
    """The run with the least CPU of ``repeat`` (the machine may be shared: CPU, not wall,
    is what a code change moves); every repeat must give the same outputs."""
    runs = [simulate(tree, trace, flags, workdir) for _ in range(repeat)]
    first = runs[0]
    for run in runs[1:]:
        if (run.text, run.report, run.records) != (first.text, first.report, first.records):
            sys.exit(f"{tree}: two runs of the same trace gave different reports")
    return min(runs, key=lambda run: run.cpu_s)


def compare(label: str, trace: Path, flags: list[str], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        print(f"\n{label}: {trace}, flags {' '.join(flags) or '(defaults)'}")
        after = best(REPO, trace, flags, args.repeat, workdir)
        print(f"  this tree  ({REPO}): wall {after.wall_s:6.2f} s, CPU {after.cpu_s:6.2f} s")
        if args.before is not None:
            before = best(args.before, trace, flags, args.repeat, workdir)
            print(
                f"  before     ({args.before}): wall {before.wall_s:6.2f} s, "
                f"CPU {before.cpu_s:6.2f} s"
            )
            same = {
                "text report": after.text == before.text,
                "--json report": after.report == before.report,
                "--requests-jsonl records": after.records == before.records,
            }
            verdict = ", ".join(f"{k} {'identical' if v else 'DIFFER'}" for k, v in same.items())
            print(f"  {verdict} (wall-time fields left out)")
            print(
                f"  after/before: CPU {after.cpu_s / before.cpu_s:.2f}x, "
                f"wall {after.wall_s / before.wall_s:.2f}x"
            )
            if not all(same.values()):
                sys.exit("reports differ: the change is not exact")
        if args.dynamo and "--num-gpu-blocks" in flags:
            blocks = int(flags[flags.index("--num-gpu-blocks") + 1])
            try:
                with plain_copy(trace) as plain:  # Dynamo's replay reads plain JSON lines
                    replayed = dynamo_replay(plain, EngineConfig(num_gpu_blocks=blocks), 1)
            except Exception as exc:  # its own checks refuse some traces: say so, go on
                print(f"  Dynamo mocker: failed on this trace ({exc})")
                return
            if replayed is None:
                print("  Dynamo mocker: skipped (pip install ai-dynamo-runtime to compare)")
                return
            wall, _ = replayed
            print(
                f"  Dynamo mocker, offline replay: wall {wall:6.2f} s; this tree takes "
                f"{after.wall_s / wall:.1f}x as long (subprocess start included)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a built tree of the commit to compare")
    parser.add_argument("--repeat", type=int, default=1, help="runs per tree (least CPU kept)")
    parser.add_argument("--multiturn", type=Path, help="the multi-turn trace (else generated)")
    parser.add_argument("--no-multiturn", action="store_true", help="skip the multi-turn trace")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake's trace")
    parser.add_argument("--kv-backend", choices=("actor", "local"), default="actor")
    parser.add_argument("--no-dynamo", dest="dynamo", action="store_false")
    args = parser.parse_args()
    backend = ["--kv-backend", args.kv_backend]
    compare("sample trace", SAMPLE, backend, args)
    if not args.no_multiturn:
        multiturn(args, ["--num-gpu-blocks", str(MULTITURN_BLOCKS), *backend])
    if args.no_mooncake:
        return
    if not MOONCAKE.is_file():
        print(f"\nMooncake trace: skipped, no file {MOONCAKE}")
        return
    for blocks in MOONCAKE_BLOCKS:
        compare("Mooncake trace", MOONCAKE, ["--num-gpu-blocks", str(blocks), *backend], args)


def multiturn(args: argparse.Namespace, flags: list[str]) -> None:
    """The multi-turn trace's comparison (generated into a temporary directory unless
    ``--multiturn`` names a copy)."""
    if args.multiturn is not None:
        compare("multi-turn trace", args.multiturn, flags, args)
        return
    if not GENERATOR.is_file():
        print(f"\nmulti-turn trace: skipped, no generator {GENERATOR}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "multiturn.jsonl"
        subprocess.run(
            [sys.executable, str(GENERATOR), *MULTITURN_ARGS, "--out", str(path)],
            check=True,
            capture_output=True,
        )
        compare("multi-turn trace", path, flags, args)


if __name__ == "__main__":
    main()
