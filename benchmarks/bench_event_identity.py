"""Before/after check of an engine-loop change: the KV events published are identical.

Runs a few simulations of the embedded workload through the Python API (`run_simulation`
with one `EventCollector` per worker: one worker, two least-loaded, three round-robin,
two in lockstep) with this tree's code and, with ``--before DIR``, with another tree's,
each in a subprocess, and prints per run the batches published and a digest of all of
them (each batch's rank, events, and ``ts`` less the epoch: its simulated end), then
whether the two trees agree.

    python benchmarks/bench_event_identity.py --before /work/base
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

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

for workers, dispatch, lockstep in RUNS:
    anyio.run(one, workers, dispatch, lockstep, REQUESTS)
"""


def digests(tree: Path, requests: int) -> list[str]:
    """The per-run lines the child prints with ``tree``'s code."""
    code = f"RUNS = {RUNS + RUNS_LOCKSTEP!r}\nREQUESTS = {requests}\n" + _CHILD
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a built tree of the commit to compare")
    parser.add_argument("--requests", type=int, default=400, help="requests per run")
    args = parser.parse_args()
    here = digests(Path(__file__).resolve().parent.parent, args.requests)
    print("this tree: workers dispatch lockstep batches digest")
    for line in here:
        print(" ", line)
    if args.before is None:
        return 0
    before = digests(args.before, args.requests)
    same = before == here
    print(f"before ({args.before}): " + ("events identical" if same else "EVENTS DIFFER"))
    if not same:
        for line in before:
            print(" ", line)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
