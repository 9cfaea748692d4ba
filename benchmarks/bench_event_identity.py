"""Before/after check of an engine-loop change: the KV events published are identical.

Runs a few simulations of the embedded workload through the Python API (`run_simulation`
with one `EventCollector` per worker: one worker, two least-loaded, three round-robin,
two in lockstep) and, with ``--traces``, the benchmark traces with KV events on (the
multi-turn trace at 4,096 blocks, Mooncake's at 1,024 and 16,384 unless
``--no-mooncake``; one worker, each batch digested as it is published, so no event is
kept), with this tree's code and, with
``--before DIR``, with another tree's, each in a subprocess, and prints per run the
batches published and a digest of all of them (each batch's rank, events, and ``ts``
less the epoch: its simulated end), then whether the two trees agree.

    python benchmarks/bench_event_identity.py --before /work/base
    python benchmarks/bench_event_identity.py --before /work/base --traces --multiturn mt.jsonl
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_engine import MOONCAKE, MOONCAKE_BLOCKS, MULTITURN_BLOCKS, multiturn_trace

RUNS = ((1, "least-loaded", False), (2, "least-loaded", False), (3, "round-robin", False))
RUNS_LOCKSTEP = ((2, "least-loaded", True),)

_CHILD = """
import hashlib, sys, anyio, msgspec
from kvpool.engine import EngineConfig, run_simulation
from kvpool.events import EventCollector
from kvpool.workloads import default_workload

async def one(workers, dispatch, lockstep, requests):
    sinks = [EventCollector() for _ in range(workers)]
    config = EngineConfig(enable_kv_cache_events=True, num_gpu_blocks=512)
    run = await run_simulation(
        default_workload(0)[:requests], config, workers=workers, dispatch=dispatch,
        sinks=sinks, lockstep=lockstep,
    )
    digest, batches = hashlib.sha256(), 0
    for sink in sinks:
        for batch in sink.batches:
            batches += 1
            ts = batch.ts - run.engines[0].epoch
            digest.update(msgspec.json.encode([ts, batch.data_parallel_rank, batch.events]))
    print(workers, dispatch, lockstep, batches, digest.hexdigest()[:16])

class Digest:  # a sink that digests each batch as it is published and keeps none

    def __init__(self):
        self.digest, self.batches = hashlib.sha256(), 0

    def publish(self, batch):
        self.batches += 1
        self.digest.update(msgspec.json.encode([batch.ts, batch.data_parallel_rank, batch.events]))

async def trace(path, blocks):
    from pathlib import Path
    from kvpool.workloads import MooncakeTrace
    sink = Digest()
    config = EngineConfig(enable_kv_cache_events=True, num_gpu_blocks=blocks)
    from unittest import mock
    # the run stamps batches from time.time() at its start: pinned, so ts is the step's end
    with MooncakeTrace(Path(path)) as requests, mock.patch("time.time", return_value=0.0):
        await run_simulation(requests, config, sinks=[sink])
    print(Path(path).name, blocks, sink.batches, sink.digest.hexdigest()[:16])

for workers, dispatch, lockstep in RUNS:
    anyio.run(one, workers, dispatch, lockstep, REQUESTS)
for path, blocks in TRACES:
    anyio.run(trace, path, blocks)
"""


def digests(tree: Path, requests: int, traces: list[tuple[str, int]]) -> list[str]:
    """The per-run lines the child prints with ``tree``'s code (run from ``tree``:
    ``python -c`` puts the working directory ahead of ``PYTHONPATH``)."""
    code = f"RUNS = {RUNS + RUNS_LOCKSTEP!r}\nREQUESTS = {requests}\nTRACES = {traces!r}\n" + _CHILD
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a built tree of the commit to compare")
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    parser.add_argument("--traces", action="store_true", help="also the benchmark traces")
    parser.add_argument("--multiturn", type=Path, help="the multi-turn trace (else generated)")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake's trace")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        traces = (
            benchmark_traces(args.multiturn, Path(tmp), not args.no_mooncake) if args.traces else []
        )
        return compare(args, traces)


def benchmark_traces(
    multiturn: Path | None, workdir: Path, mooncake: bool
) -> list[tuple[str, int]]:
    """The traces and pool sizes `bench_engine` runs (the multi-turn one generated into
    ``workdir`` unless given; Mooncake's if ``mooncake``), those that exist."""
    traces: list[tuple[str, int]] = []
    path = multiturn_trace(multiturn, workdir)
    if path is not None:
        traces.append((str(path), MULTITURN_BLOCKS))
    if mooncake and MOONCAKE.is_file():
        traces += [(str(MOONCAKE), blocks) for blocks in MOONCAKE_BLOCKS]
    return traces


def compare(args: argparse.Namespace, traces: list[tuple[str, int]]) -> int:
    """Print this tree's digests and, with ``--before``, whether that tree's agree."""
    here = digests(Path(__file__).resolve().parent.parent, args.requests, traces)
    print("this tree: workers dispatch lockstep batches digest (traces: name blocks ...)")
    for line in here:
        print(" ", line)
    if args.before is None:
        return 0
    before = digests(args.before, args.requests, traces)
    same = before == here
    print(f"before ({args.before}): " + ("events identical" if same else "EVENTS DIFFER"))
    if not same:
        for line in before:
            print(" ", line)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
