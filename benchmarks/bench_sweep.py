"""Wall time of ``kvpool sweep`` on a 4-configuration grid: one process per core against
the same runs one after another (in one process, and as four ``kvpool simulate``
commands), with every report checked equal across the three (wall-clock figures aside).
CPU time over wall time says how many cores' worth each got: on a machine shared with
other work, two processes at once may get little more than one did.

The grid: the embedded default workload (``--sessions``), 2 workers, ``num-gpu-blocks``
1024 and 2048 times ``dispatch`` least-loaded and round-robin; about a minute in all.

Reproduce: ``python benchmarks/bench_sweep.py`` (``--jobs``, ``--sessions``; ``--quick``
for a smoke run).
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
from pathlib import Path
from typing import Any

GRID = ("num-gpu-blocks=1024,2048", "dispatch=least-loaded,round-robin", "workers=2")
WALL = ("wall_s", "requests_per_wall_s")


def kvpool(*args: str) -> tuple[float, float]:
    """Run ``python -m kvpool ARGS`` quietly: its wall time and the CPU time of it and
    its worker processes, in seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def sweep(jobs: int, sessions: int, table: Path) -> tuple[float, float]:
    grids = [arg for spec in (*GRID, f"sessions={sessions}") for arg in ("--grid", spec)]
    return kvpool("sweep", *grids, "--jobs", str(jobs), "--json", str(table))


def reports(table: Path) -> list[dict[str, Any]]:
    runs = json.loads(table.read_bytes())["runs"]
    assert all(row["status"] == "ok" for row in runs), runs
    return [without_wall(row["report"]) for row in runs]


def without_wall(report: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in report.items() if key not in WALL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="processes (default: 2)")
    parser.add_argument("--sessions", type=int, default=500, help="(default: 500)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 sessions")
    options = parser.parse_args()
    sessions = 20 if options.quick else options.sessions
    load = os.getloadavg()[0]  # the machine is shared: the speed-up depends on it
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        parallel = sweep(options.jobs, sessions, folder / "parallel.json")
        inline = sweep(1, sessions, folder / "inline.json")
        # the same four runs as a user would type them, one command each
        alone_s = alone_cpu = 0.0
        alone: list[dict[str, Any]] = []
        table = json.loads((folder / "parallel.json").read_bytes())
        for index, row in enumerate(table["runs"]):
            target = folder / f"alone{index}.json"
            flags = [f"--{key}={value}" for key, value in row["params"].items()]
            wall, cpu = kvpool("simulate", *flags, "--json", str(target))
            alone_s += wall
            alone_cpu += cpu
            alone.append(without_wall(json.loads(target.read_bytes())))
        same = reports(folder / "parallel.json") == reports(folder / "inline.json") == alone
        run_s = [row["run_wall_s"] for row in table["runs"]]
        inline_runs = json.loads((folder / "inline.json").read_bytes())["runs"]
        turn_s = [row["run_wall_s"] for row in inline_runs]
    cores = len(os.sched_getaffinity(0))
    print(
        f"kvpool sweep, 4 configurations ({', '.join(GRID)}, sessions={sessions}); "
        f"{cores} cores, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        f"  each run's wall time: {', '.join(f'{s:.2f}' for s in run_s)} s in the parallel "
        f"sweep, {', '.join(f'{s:.2f}' for s in turn_s)} s in turn"
    )
    rows = (
        (f"sweep --jobs {options.jobs}", parallel),
        ("sweep --jobs 1 (in turn)", inline),
        ("4 x kvpool simulate in turn", (alone_s, alone_cpu)),
    )
    for name, (wall, cpu) in rows:
        # CPU over wall: the cores' worth the machine's other load left the runs
        print(f"  {name:<28} {wall:6.2f} s wall, {cpu:6.2f} s CPU ({cpu / wall:.2f} cores busy)")
    print(
        f"  speed-up of sweep --jobs {options.jobs}: {inline[0] / parallel[0]:.2f}x over sweep "
        f"--jobs 1, {alone_s / parallel[0]:.2f}x over 4 x kvpool simulate"
    )
    print(f"  reports identical across the three (wall time aside): {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
