"""Longer runs of the actor fuzzer (tests/support/actor_fuzz.py, which the suite runs briefly).

Run:  python benchmarks/fuzz_actor.py                 (about a minute: 3 loops x 20 s)
      python benchmarks/fuzz_actor.py --seconds 600   (ten minutes per loop)
      python benchmarks/fuzz_actor.py --quick         (a smoke run)
      python benchmarks/fuzz_actor.py --seed 1234 --loops trio   (replay one seed)

Each loop (asyncio, uvloop, trio) runs seeds from ``--first`` on, one pool run and one
manager run per seed, until its time is up, and prints the seeds it ran and the counts:
runs by ending, calls by kind and cancellation mode, outcomes. A breach stops the loop
and prints the seed that found it (replay it with ``--seed``); the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from actor_fuzz import Counts, fuzz

LOOPS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def run_loop(name: str, first: int, seconds: float, only: int | None) -> bool:
    backend, options = LOOPS[name]
    counts = Counts()
    seed = first if only is None else only
    started = time.perf_counter()
    ran = 0
    while True:
        try:
            counts.add(
                anyio.run(fuzz, range(seed, seed + 1), backend=backend, backend_options=options)
            )
        except BaseException:
            traceback.print_exc()
            print(f"{name}: BREACH at seed {seed} (replay: --seed {seed} --loops {name})")
            return False
        ran += 1
        seed += 1
        if only is not None or time.perf_counter() - started >= seconds:
            break
    wall = time.perf_counter() - started
    last = seed - 1
    start = first if only is None else only
    print(f"\n{name}: seeds {start}..{last} ({ran} seeds, {wall:.1f} s), no breach")
    print("  runs:    " + ", ".join(f"{k} {v}" for k, v in sorted(counts.runs.items())))
    print("  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.outcomes.items())))
    print(f"  calls:   {sum(counts.calls.values())} in {len(counts.calls)} kind/mode pairs")
    for mode in sorted({key.split(" / ")[1] for key in counts.calls}):
        total = sum(v for k, v in counts.calls.items() if k.endswith(f" / {mode}"))
        print(f"    {mode:16} {total}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per loop")
    parser.add_argument("--first", type=int, default=1000, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="run this one seed only")
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--quick", action="store_true", help="a few seconds in all")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else args.seconds
    ok = all(run_loop(name, args.first, seconds, args.seed) for name in args.loops.split(","))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
