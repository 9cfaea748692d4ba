"""Engine benchmark: simulated requests per wall second, and where the wall time goes.

    python benchmarks/bench_engine.py            # embedded default, every KV backend
    python benchmarks/bench_engine.py --repeat 5 --workers 2

For each KV backend (``local``: a `KvManager` called inline; ``actor``: the manager behind
the pool actor, one actor per worker) it runs `kvpool simulate`'s embedded default
workload with the CLI's default flags and prints, best of ``--repeat`` runs:

- wall seconds and simulated requests per wall second;
- the share of wall time spent awaiting KV calls (`TimedKvClient`): the manager, the
  pool and, for the actor, the round trip through it; the rest is the scheduler, the
  simulation loop and workload generation;
- for the actor, the share of wall time spent handling its messages (its handlers:
  manager and pool work, timed around each handler, whichever task runs it), without the task
  switches of a round trip;
- from one cProfile run: the share of (profiled) time inside the pool core, the manager
  and hashing, the actor machinery, and the engine.

Targets (issue 5): the embedded default completes in under 15 s; the pool is not the
bottleneck (its share under half of wall time). Issue 9: the actor backend is no slower
than before the actor became one task with one mailbox; `BEFORE_ISSUE_9` is that run's
figure, measured on this machine class (reproduce it at that commit with this script).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import anyio

from kvpool.engine import EngineConfig, KvClient, TimedKvClient
from kvpool.engine.runner import KV_BACKENDS, KvFactory, SimulationRun, run_simulation
from kvpool.workloads import RequestSpec, default_workload

BEFORE_ISSUE_9 = ("92c3dcf", 1.09)
"""(commit, best-of-3 wall seconds) of the actor backend on the embedded default, with
direct turns and a deque mailbox, measured 2026-11-30 on the 2-core EPYC VM."""


class ActorTurnTimer:
    """Adds up the wall time the actors spend in their handlers (manager and pool work).
    Wraps every handler of each actor created while the timer is active."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> ActorTurnTimer:
        from kvpool.actors import Actor, Handler

        original = Actor.__init__
        timed = self._timed

        def init(actor: Any, handlers: Any, slots: Any) -> None:
            original(
                actor,
                {
                    kind: Handler(timed(h.handle), h.undo, h.gives_back, h.waits)
                    for kind, h in handlers.items()
                },
                slots,
            )

        self._original = original
        Actor.__init__ = init  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        from kvpool.actors import Actor

        Actor.__init__ = self._original  # type: ignore[method-assign]

    def _timed(self, handle: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed_handle(message: Any) -> Any:
            start = time.perf_counter()
            try:
                return handle(message)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_handle


def run_once(
    requests: list[RequestSpec], workers: int, factory: KvFactory
) -> tuple[SimulationRun, float, float, float]:
    """One simulation: the run, its wall seconds, seconds spent awaiting KV calls, and
    seconds the pool actors spent in their turns (0 without actors)."""
    timers: list[TimedKvClient] = []

    def wrap(kv: KvClient) -> KvClient:
        timed = TimedKvClient(kv)
        timers.append(timed)
        return timed

    async def go() -> SimulationRun:
        return await run_simulation(
            requests, EngineConfig(), workers=workers, kv_factory=factory, wrap_kv=wrap
        )

    with ActorTurnTimer() as turns:
        start = time.perf_counter()
        run = anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})
        wall = time.perf_counter() - start
    return run, wall, sum(t.seconds for t in timers), turns.seconds


_GROUPS: list[tuple[str, Callable[[str], bool]]] = [
    # the pool core is compiled (mypyc): its methods show up as builtins of BlockPool
    ("pool core (kvpool/pool)", lambda f: "/kvpool/pool/" in f or "BlockPool" in f),
    ("manager + hashing", lambda f: "/kvpool/manager/" in f or "/kvpool/hashing/" in f),
    ("actor + messages", lambda f: "/kvpool/actors/" in f or "/kvpool/messages/" in f),
    ("engine + simulation", lambda f: "/kvpool/engine/" in f),
    ("workload generation", lambda f: "/kvpool/workloads/" in f),
    ("event loop, anyio, other", lambda f: True),
]


def profile_shares(requests: list[RequestSpec], workers: int, factory: KvFactory) -> None:
    """Print the share of profiled time (tottime) per part of kvpool."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(requests, workers, factory)
    profiler.disable()
    stats = pstats.Stats(profiler)
    totals = dict.fromkeys((name for name, _ in _GROUPS), 0.0)
    for (filename, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        tottime = row[2]
        where = filename if filename != "~" else function
        for name, matches in _GROUPS:
            if matches(where):
                totals[name] += tottime
                break
    grand = sum(totals.values())
    for name, seconds in totals.items():
        print(f"    {name:28s} {100 * seconds / grand:5.1f}%")


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per backend (best kept)")
    parser.add_argument("--workers", type=int, default=1, help="engines (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    args = parser.parse_args()

    requests = default_workload(args.seed)
    print(
        f"embedded default workload: {len(requests)} requests, seed {args.seed}, "
        f"{args.workers} worker(s), default engine flags, uvloop"
    )
    for name, factory in KV_BACKENDS.items():
        best: tuple[float, float, float, SimulationRun] | None = None
        for _ in range(args.repeat):
            run, wall, kv_seconds, turn_seconds = run_once(requests, args.workers, factory)
            if best is None or wall < best[0]:
                best = (wall, kv_seconds, turn_seconds, run)
        assert best is not None
        wall, kv_seconds, turn_seconds, run = best
        total = run.report.total
        assert total.leaked_blocks == 0
        print(f"\n[{name}] best of {args.repeat}")
        print(f"  wall time                {wall:8.2f} s  (target < 15 s)")
        if name == "actor":
            commit, seconds = BEFORE_ISSUE_9
            print(f"  before issue 9 ({commit})  {seconds:8.2f} s  (same workload, best of 3)")
        print(f"  simulated time           {run.report.simulated_s:8.2f} s")
        print(f"  requests per wall second {total.requests_submitted / wall:8.0f}")
        print(f"  steps per wall second    {total.steps / wall:8.0f}")
        print(
            f"  awaiting KV calls        {100 * kv_seconds / wall:7.1f} % of wall time "
            "(target < 50 %)"
        )
        if turn_seconds:
            print(
                f"  inside pool actor turns  {100 * turn_seconds / wall:7.1f} % of wall time "
                "(the actor's own work: manager + pool; target < 50 %)"
            )
        print(
            f"  preemptions {total.preemptions}, evictions {total.evictions}, "
            f"hit rate {100 * (total.prefix_cache_hit_rate or 0.0):.1f}%"
        )
        if not args.no_profile:
            print("  cProfile, share of profiled time:")
            profile_shares(requests, args.workers, factory)


if __name__ == "__main__":
    main()
