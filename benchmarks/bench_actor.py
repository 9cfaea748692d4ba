"""Pool actor cost: microseconds per round trip, and a block workload against a bare pool.

Run:  python benchmarks/bench_actor.py            (about 40 s)
      python benchmarks/bench_actor.py --quick    (about 10 s, smaller counts)

1. Round trip: N concurrent client tasks each await ``prefix_hit`` (a trivial call) in a
   loop; the figure is CPU time / total calls, for N in 1, 10, 100, 1000, on asyncio,
   asyncio+uvloop and trio. CPU time, not wall time, because the machine is shared
   (the loop never idles, so the two agree on a quiet machine); best of a few repeats.
   The first columns are the default: a caller of an idle actor takes the turn itself
   (a direct turn) and yields to the loop once every 32 such turns (the cooperative
   budget, ``yield_every``); on trio each also passes a cancel point. "yield every
   call" sets ``yield_every=1``: each direct turn is followed by a task switch.
   "mailbox only" turns direct turns off, so every call is posted to the actor and
   answered through a reply slot. The "floor" columns run that posted round trip with
   no actor at all (a server task answering loop futures, or rescheduling parked trio
   tasks): the loop's own cost of a posted call. The clock starts once every client
   task is running, so task start-up is not counted.
2. Workload: cycles of ``admit`` (32-block chain, shared prefixes) + ``cache_many`` of
   the fresh blocks + ``free``, through the actor with C concurrent clients, against
   the same cycles driven straight on a bare `BlockPool` in the same process (ratio =
   actor throughput / bare throughput; target >= 0.7). The bare pool runs them both
   with the same calls (its ``admit``, ``cache_many`` and ``release_many``) and with
   its per-block calls; the second ratio is against the faster of the two per turn.
   "handlers, no loop" calls the actor's handlers directly: the price of the protocol
   without any messaging.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import sniffio

from kvpool.actors import YIELD_EVERY, PoolClient, PoolState, open_pool
from kvpool.messages import Admit, CacheMany, Free
from kvpool.pool import BlockPool

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

CHAIN = 32
CAPACITY = 4096


def backends() -> list[tuple[str, str, dict[str, Any]]]:
    found: list[tuple[str, str, dict[str, Any]]] = [("asyncio", "asyncio", {})]
    if uvloop is not None:
        found.append(("uvloop", "asyncio", {"loop_factory": uvloop.new_event_loop}))
    found.append(("trio", "trio", {}))
    return found


async def round_trips(
    clients: int, total_calls: int, yield_every: int = YIELD_EVERY, direct: bool = True
) -> float:
    """Microseconds per round trip with ``clients`` tasks sharing ``total_calls`` calls;
    ``direct=False`` makes every call go through the mailbox (no direct turns)."""
    per_client = max(total_calls // clients, 1)
    async with open_pool(64, yield_every=yield_every) as pool:
        pool._actor.direct_turns = direct

        async def client() -> None:
            hit = pool.prefix_hit
            for _ in range(per_client):
                await hit(7)

        return await _timed_clients(clients, client) / (per_client * clients) * 1e6


async def _timed_clients(clients: int, client: Callable[[], Awaitable[None]]) -> float:
    """CPU seconds for ``clients`` tasks running ``client`` to completion, counted from
    the moment all of them are running: the calls, not the tasks' start-up (starting an
    anyio task costs 30-40 us here, which would swamp 1,000 clients' 20 calls each)."""
    go = anyio.Event()
    started = 0

    async def wait_then_run() -> None:
        nonlocal started
        started += 1
        await go.wait()
        await client()

    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(wait_then_run)
        while started < clients:
            await anyio.sleep(0)
        began = time.process_time()
        go.set()
    return time.process_time() - began


async def ping_pong_floor(clients: int, total_calls: int) -> float:
    """The same round trip with no actor: a server task answering loop futures (asyncio)
    or rescheduling parked tasks (trio), as cheaply as each loop allows."""
    per_client = max(total_calls // clients, 1)
    queue: deque[tuple[int, Any]] = deque()
    if sniffio.current_async_library() == "trio":
        import outcome
        import trio

        lowlevel = trio.lowlevel
        sleeper: list[Any] = []

        def abort(_: Any) -> Any:
            return lowlevel.Abort.SUCCEEDED

        async def serve() -> None:
            while True:
                while queue:
                    value, task = queue.popleft()
                    lowlevel.reschedule(task, outcome.Value(value))
                sleeper.append(lowlevel.current_task())
                await lowlevel.wait_task_rescheduled(abort)

        async def client() -> None:
            for _ in range(per_client):
                queue.append((7, lowlevel.current_task()))
                if sleeper:
                    lowlevel.reschedule(sleeper.pop())
                await lowlevel.wait_task_rescheduled(abort)

    else:
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[None]] = []

        async def serve() -> None:
            while True:
                while queue:
                    value, future = queue.popleft()
                    future.set_result(value)
                wake = loop.create_future()
                waiting.append(wake)
                await wake

        async def client() -> None:
            for _ in range(per_client):
                future = loop.create_future()
                queue.append((7, future))
                if waiting:
                    waiting.pop().set_result(None)
                await future

    async with anyio.create_task_group() as server:
        server.start_soon(serve)
        elapsed = await _timed_clients(clients, client)
        server.cancel_scope.cancel()
    return elapsed / (per_client * clients) * 1e6


def handler_cycles(chains: list[list[int]]) -> float:
    """Seconds for the workload through the actor's handlers, called directly (no loop)."""
    state = PoolState(BlockPool(CAPACITY), lambda: 0)
    started = time.process_time()
    for chain in chains:
        admission = state.admit(Admit(chain)).admission  # type: ignore[union-attr]
        cached = admission.cached
        fresh = admission.blocks[cached:]
        state.cache_many(CacheMany(list(zip(fresh, chain[cached:], strict=True))))
        state.free(Free(admission.blocks))
    return time.process_time() - started


def dispatch_costs(repeats: int) -> dict[str, tuple[float, float]]:
    """Nanoseconds to find a message's handler: a dict on the type, or a ``match`` whose
    cases are ordered by expected frequency; for the first and the last case."""
    from kvpool import messages as m

    kinds = [
        m.QueryPrefix, m.Admit, m.CacheMany, m.Free, m.Reserve, m.ActivatePrefix,
        m.AllocatePrivate, m.AllocateCached, m.CachePrivate, m.Release, m.Cancel,
        m.GetStats, m.CheckInvariants,
    ]  # fmt: skip
    table = {kind: index for index, kind in enumerate(kinds)}

    def by_dict(message: Any) -> int:
        return table[type(message)]

    def by_match(message: Any) -> int:
        match message:
            case m.QueryPrefix():
                return 0
            case m.Admit():
                return 1
            case m.CacheMany():
                return 2
            case m.Free():
                return 3
            case m.Reserve():
                return 4
            case m.ActivatePrefix():
                return 5
            case m.AllocatePrivate():
                return 6
            case m.AllocateCached():
                return 7
            case m.CachePrivate():
                return 8
            case m.Release():
                return 9
            case m.Cancel():
                return 10
            case m.GetStats():
                return 11
            case _:
                return 12

    first, last = m.QueryPrefix(1), m.CheckInvariants()
    results = {}
    for name, function in (("dict on type", by_dict), ("match", by_match)):
        costs = []
        for message in (first, last):
            batch = [message] * 10_000
            best_time = min(_timed(function, batch) for _ in range(repeats))
            costs.append(best_time / len(batch) * 1e9)
        results[name] = (costs[0], costs[1])
    return results


def _timed(function: Callable[[Any], int], batch: list[Any]) -> float:
    started = time.process_time()
    for message in batch:
        function(message)
    return time.process_time() - started


def make_chains(count: int, seed: int = 1) -> list[list[int]]:
    """32-hash chains: half of them share one of 16 system prefixes of 8 to 24 blocks."""
    rng = random.Random(seed)
    templates = [[rng.getrandbits(64) for _ in range(24)] for _ in range(16)]
    chains = []
    for _ in range(count):
        shared = rng.choice(templates)[: rng.randint(8, 24)] if rng.random() < 0.5 else []
        chains.append(shared + [rng.getrandbits(64) for _ in range(CHAIN - len(shared))])
    return chains


def bare_cycles(chains: list[list[int]], batched: bool = True) -> float:
    """Seconds for the workload straight on a BlockPool. Batched: its fastest calls for
    the same cycle (one admit, one cache_many, one release_many leaf first); otherwise
    the steps of admit spelled out (match_prefix, reserve, activate_prefix, one
    allocate_private per block, cancel) and one cache_private and one release per
    block, the per-block API a caller without the batch calls would write."""
    pool = BlockPool(CAPACITY)
    started = time.process_time()
    for chain in chains:
        if batched:
            admission = pool.admit(chain)
            assert admission is not None
            cached = admission.cached
            pool.cache_many(list(zip(admission.blocks[cached:], chain[cached:], strict=True)))
            pool.release_many(admission.blocks[::-1])
            continue
        hits, _active = pool.match_prefix(chain)
        outcome = pool.reserve(chain[:hits], len(chain) - hits)
        assert outcome is not None
        reservation = outcome.reservation
        blocks = pool.activate_prefix(reservation)
        blocks += [pool.allocate_private(reservation) for _ in range(reservation.fresh)]
        pool.cancel(reservation)
        for block_id, block_hash in zip(blocks[hits:], chain[hits:], strict=True):
            pool.cache_private(block_id, block_hash)
        for block_id in reversed(blocks):
            pool.release(block_id)
    return time.process_time() - started


async def actor_cycles(
    chains: list[list[int]], clients: int, yield_every: int = YIELD_EVERY
) -> float:
    """Seconds for the same workload through the actor with ``clients`` tasks."""
    async with open_pool(CAPACITY, yield_every=yield_every) as pool:

        async def client(mine: list[list[int]], pool: PoolClient) -> None:
            for chain in mine:
                admission = await pool.admit(chain)
                assert admission is not None
                cached = admission.cached
                fresh = admission.blocks[cached:]
                await pool.cache_many(list(zip(fresh, chain[cached:], strict=True)))
                await pool.free(admission.blocks)

        started = time.process_time()
        async with anyio.create_task_group() as tg:
            for index in range(clients):
                tg.start_soon(client, chains[index::clients], pool)
        return time.process_time() - started


def interleaved(variants: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, float]:
    """Best time of each variant, the repeats taken in turns so that a noisy neighbour
    on this shared machine slows every variant alike rather than one of them."""
    return {key: min(values) for key, values in in_turns(variants, repeats).items()}


def in_turns(variants: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, list[float]]:
    """Every time of each variant, one run of each per turn. Each run starts from a
    full collection, so that no run pays for the garbage an earlier one left (the
    collector stays on during the run: each pays for its own)."""
    times: dict[Any, list[float]] = {key: [] for key in variants}
    for _ in range(repeats):
        for key, run in variants.items():
            gc.collect()
            times[key].append(run())
    return times


def paired_ratio(bare: list[float], other: list[float]) -> float:
    """Median over turns of bare time / other time: runs of one turn are seconds apart,
    so a neighbour's burst skews one turn's pair, not the median."""
    return statistics.median(b / o for b, o in zip(bare, other, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts, fewer repeats")
    args = parser.parse_args()
    calls = 10_000 if args.quick else 20_000
    cycles = 300 if args.quick else 1_000
    repeats = 2 if args.quick else 5

    names = [name for name, _, _ in backends()]
    print(f"reproduce: python benchmarks/bench_actor.py{' --quick' if args.quick else ''}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}")
    print(
        f"round trip, microseconds of CPU per call (prefix_hit; {calls} calls, best of {repeats})"
    )
    kinds: list[tuple[str, str, Callable[..., Any], tuple[Any, ...]]] = [
        ("actor", f"default (yield every {YIELD_EVERY})", round_trips, ()),
        ("every", "yield every call", round_trips, (1,)),
        ("mailbox", "mailbox only", round_trips, (1, False)),
        ("floor", "floor: no actor", ping_pong_floor, ()),
    ]
    width = 8 * len(names)
    print(f"{'':8}" + "".join(f" | {title:{width}s}" for _, title, _, _ in kinds))
    print(f"{'clients':>8}" + " | ".join("" for _ in range(1)) + "".join(
        " | " + "".join(f"{name:>8}" for name in names) for _ in kinds
    ))  # fmt: skip
    variants: dict[Any, Callable[[], float]] = {}
    for name, backend, options in backends():
        for clients in (1, 10, 100, 1000):
            for kind, _, bench, extra in kinds:
                variants[kind, name, clients] = (
                    lambda f=bench, c=clients, e=extra, b=backend, o=options: anyio.run(
                        f, c, calls, *e, backend=b, backend_options=o
                    )
                )
    table = interleaved(variants, repeats)
    for clients in (1, 10, 100, 1000):
        groups = (
            "".join(f"{table[kind, name, clients]:8.2f}" for name in names) for kind, *_ in kinds
        )
        print(f"{clients:>8}" + "".join(f" | {group}" for group in groups))

    print("\ndispatch, nanoseconds per message (first kind / last kind of 13)")
    for name, (first, last) in dispatch_costs(5).items():
        print(f"  {name:14s} {first:7.1f} / {last:7.1f}")

    chains = make_chains(cycles)
    workload: dict[Any, Callable[[], float]] = {
        "bare": lambda: bare_cycles(chains),
        "per-block": lambda: bare_cycles(chains, batched=False),
        "handlers": lambda: handler_cycles(chains),
    }
    for name, backend, options in backends():
        for clients, yield_every in ((1, YIELD_EVERY), (16, YIELD_EVERY), (16, 1)):
            workload[name, clients, yield_every] = (
                lambda c=clients, y=yield_every, b=backend, o=options: anyio.run(
                    actor_cycles, chains, c, y, backend=b, backend_options=o
                )
            )
    turns = 3 * repeats  # a turn takes well under a second: more turns, steadier ratios
    runs = in_turns(workload, turns)
    bare_runs = runs.pop("bare")
    per_block_runs = runs.pop("per-block")
    print(
        f"\nworkload: {cycles} cycles of admit({CHAIN}) + cache_many + free, "
        f"capacity {CAPACITY}, CPU time, best of {turns} turns; ratios = throughput vs a "
        "bare pool, median of the turns' pairs"
    )
    # The same three calls (admit, cache_many, free) on the bare pool, and the bare pool at
    # its best: per turn, the faster of its batch and per-block ways.
    best_bare = [min(pair) for pair in zip(bare_runs, per_block_runs, strict=True)]
    print(f"  {'bare BlockPool, batch calls:':42s} {min(bare_runs) / cycles * 1e6:8.2f} us/cycle")
    print(
        f"  {'bare BlockPool, per-block calls:':42s} "
        f"{min(per_block_runs) / cycles * 1e6:8.2f} us/cycle"
    )
    print(f"{'':44s}{'':17s}  vs the same calls  vs the faster bare way")
    for key, through in runs.items():
        label = "actor handlers, no loop:" if key == "handlers" else (
            f"actor {key[0]:7s} {key[1]:2d} clients, yield every {key[2]:2d}:"
        )  # fmt: skip
        print(
            f"  {label:42s} {min(through) / cycles * 1e6:8.2f} us/cycle"
            f"  {paired_ratio(bare_runs, through):16.2f}x"
            f"  {paired_ratio(best_bare, through):21.2f}x"
        )


if __name__ == "__main__":
    main()
