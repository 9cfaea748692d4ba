"""Pool actor cost: a trivial call's round trip against a minimal actor, and a workload.

Run:  python benchmarks/bench_actor.py            (about 40 s)
      python benchmarks/bench_actor.py --quick    (a few seconds: a smoke run)

1. Round trip: N concurrent client tasks each await ``prefix_hit`` (a trivial call) in
   a loop, for N in 1, 10, 100, 1000, on asyncio, asyncio+uvloop and trio. The figure
   is CPU microseconds per call (CPU, not wall, because the machine is shared; the loop
   never idles, so the two agree on a quiet machine), best of the repeats, counted once
   every client task is running. Beside it, in the same run, a *minimal hand-written
   actor* (`minimal_actor`): one ``call`` coroutine posting to an anyio memory object
   stream with ``send_nowait``, drained in batches, replying through a loop future (on
   trio, rescheduling the parked task), with no cancellation handling, no dispatch, no
   undo. The target: kvpool's
   round trip at 100 clients on uvloop within 1.5x of the minimal actor's.
2. Workload: cycles of ``admit`` (a 32-block chain, half of them sharing a system
   prefix) + ``cache_many`` of the fresh blocks + ``free``, through the actor from 1
   and 16 concurrent clients, against the same three calls made straight on a bare
   `BlockPool` in the same process. Ratio = bare time / actor time (median of per-turn
   pairs); the target: at least 0.7 from 16 clients on uvloop. Beside them, the
   minimal actor of section 1 making the same three calls from 16 clients: the floor
   of what a round trip per call costs on this loop.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import sniffio

from kvpool.actors import PoolClient, open_pool
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


async def _timed_clients(clients: int, client: Callable[[], Awaitable[None]]) -> float:
    """CPU seconds for ``clients`` tasks running ``client``, counted from the moment all
    of them are running (starting an anyio task costs 30-40 us here, which would swamp
    1,000 clients' few calls each)."""
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


async def kvpool_round_trips(clients: int, total_calls: int) -> float:
    """Microseconds per ``prefix_hit`` through kvpool's actor."""
    per_client = max(total_calls // clients, 1)
    async with open_pool(64) as pool:

        async def client() -> None:
            hit = pool.prefix_hit
            for _ in range(per_client):
                await hit(7)

        elapsed = await _timed_clients(clients, client)
    return elapsed / (per_client * clients) * 1e6


def minimal_actor(
    handle: Callable[[Any], Any],
) -> tuple[Callable[[], Coroutine[Any, Any, None]], Callable[[Any], Awaitable[Any]]]:
    """The minimal hand-written actor on the running loop: its task's body and its call.

    ``call(payload)`` posts ``(payload, slot)`` with ``send_nowait`` to an unbounded
    anyio memory object stream and awaits the slot (a loop future; on trio, the parked
    task); the actor drains the stream in batches and replies ``handle(payload)``. No
    cancellation handling, no dispatch, no undo: the floor of a round trip per call.
    """
    send, receive = anyio.create_memory_object_stream[tuple[Any, Any]](math.inf)
    post = send.send_nowait
    if sniffio.current_async_library() == "trio":
        import outcome
        import trio

        lowlevel = trio.lowlevel

        def abort(_: Any) -> Any:
            return lowlevel.Abort.SUCCEEDED

        def reply(slot: Any, value: Any) -> None:
            lowlevel.reschedule(slot, outcome.Value(value))

        async def call(payload: Any) -> Any:
            post((payload, lowlevel.current_task()))
            return await lowlevel.wait_task_rescheduled(abort)

    else:
        new_future = asyncio.get_running_loop().create_future

        def reply(slot: Any, value: Any) -> None:
            slot.set_result(value)

        async def call(payload: Any) -> Any:
            future = new_future()
            post((payload, future))
            return await future

    async def actor() -> None:
        while True:
            item = await receive.receive()
            while True:
                payload, slot = item
                reply(slot, handle(payload))
                try:
                    item = receive.receive_nowait()
                except anyio.WouldBlock:
                    break

    return actor, call


async def minimal_round_trips(clients: int, total_calls: int) -> float:
    """Microseconds per call through `minimal_actor` (a dict lookup as the handler)."""
    per_client = max(total_calls // clients, 1)
    resident: dict[int, bool] = {}
    actor, call = minimal_actor(resident.get)

    async def client() -> None:
        for _ in range(per_client):
            await call(7)

    async with anyio.create_task_group() as server:
        server.start_soon(actor)
        elapsed = await _timed_clients(clients, client)
        server.cancel_scope.cancel()
    return elapsed / (per_client * clients) * 1e6


def make_chains(count: int, seed: int = 1) -> list[list[int]]:
    """32-hash chains: half of them share one of 16 system prefixes of 8 to 24 blocks."""
    rng = random.Random(seed)
    templates = [[rng.getrandbits(64) for _ in range(24)] for _ in range(16)]
    chains = []
    for _ in range(count):
        shared = rng.choice(templates)[: rng.randint(8, 24)] if rng.random() < 0.5 else []
        chains.append(shared + [rng.getrandbits(64) for _ in range(CHAIN - len(shared))])
    return chains


def bare_cycles(chains: list[list[int]]) -> float:
    """CPU seconds for the workload straight on a BlockPool, with the same three calls."""
    pool = BlockPool(CAPACITY)
    started = time.process_time()
    for chain in chains:
        admission = pool.admit(chain)
        assert admission is not None
        cached = admission.cached
        pool.cache_many(list(zip(admission.blocks[cached:], chain[cached:], strict=True)))
        pool.release_many(admission.blocks[::-1])
    return time.process_time() - started


async def actor_cycles(chains: list[list[int]], clients: int) -> float:
    """CPU seconds for the same workload through the actor with ``clients`` tasks."""
    async with open_pool(CAPACITY) as pool:

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


def _apply(work: tuple[Callable[[Any], Any], Any]) -> Any:
    method, argument = work
    return method(argument)


async def minimal_cycles(chains: list[list[int]], clients: int) -> float:
    """CPU seconds for the same workload through `minimal_actor` calling the bare
    pool's methods: the floor of any actor's price for the same calls."""
    pool = BlockPool(CAPACITY)
    actor, call = minimal_actor(_apply)

    async def client(mine: list[list[int]]) -> None:
        for chain in mine:
            admission = await call((pool.admit, chain))
            cached = admission.cached
            fresh = admission.blocks[cached:]
            await call((pool.cache_many, list(zip(fresh, chain[cached:], strict=True))))
            await call((pool.release_many, admission.blocks[::-1]))

    async with anyio.create_task_group() as server:
        server.start_soon(actor)
        started = time.process_time()
        async with anyio.create_task_group() as tg:
            for index in range(clients):
                tg.start_soon(client, chains[index::clients])
        elapsed = time.process_time() - started
        server.cancel_scope.cancel()
    return elapsed


def in_turns(variants: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, list[float]]:
    """Every time of each variant, one run of each per turn, each after a full
    collection: a noisy neighbour slows every variant of a turn alike."""
    times: dict[Any, list[float]] = {key: [] for key in variants}
    for _ in range(repeats):
        for key, run in variants.items():
            gc.collect()
            times[key].append(run())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts, fewer repeats")
    args = parser.parse_args()
    calls, repeats, cycles = (4_000, 1, 200) if args.quick else (60_000, 5, 2_000)
    client_counts = (1, 10, 100, 1000)

    print("1. Round trip of a trivial call (prefix_hit), CPU us per call, best of", repeats)
    print(f"{'clients':>8}" + "".join(f"{name:>10}{'minimal':>9}" for name, *_ in backends()))
    figures: dict[tuple[str, int], tuple[float, float]] = {}
    for clients in client_counts:
        row = f"{clients:>8}"
        for name, backend, options in backends():

            def run(fn: Any, c: int = clients, b: str = backend, o: Any = options) -> float:
                return float(anyio.run(fn, c, calls, backend=b, backend_options=o))

            times = in_turns(
                {
                    "kvpool": lambda: run(kvpool_round_trips),
                    "min": lambda: run(minimal_round_trips),
                },
                repeats,
            )
            ours, minimal = min(times["kvpool"]), min(times["min"])
            figures[name, clients] = (ours, minimal)
            row += f"{ours:>10.2f}{minimal:>9.2f}"
        print(row)
    for name, *_ in backends():
        ours, minimal = figures[name, 100]
        print(
            f"  {name:<8} at 100 clients: kvpool {ours:.2f} us, minimal actor {minimal:.2f} us,"
            f" ratio {ours / minimal:.2f}x" + ("  (target <= 1.5x)" if name == "uvloop" else "")
        )

    chains = make_chains(cycles)
    print(f"\n2. Workload: {cycles} cycles of 32-block admit + cache_many + free")
    for name, backend, options in backends():
        variants: dict[Any, Callable[[], float]] = {"bare": lambda: bare_cycles(chains)}
        for clients in (1, 16):
            variants[clients] = lambda c=clients, b=backend, o=options: anyio.run(
                actor_cycles, chains, c, backend=b, backend_options=o
            )
        variants["minimal"] = lambda b=backend, o=options: anyio.run(
            minimal_cycles, chains, 16, backend=b, backend_options=o
        )
        times = in_turns(variants, repeats)
        bare_us = min(times["bare"]) / cycles * 1e6
        line = f"  {name:<8} bare pool {bare_us:5.1f} us/cycle"
        for key in (1, 16, "minimal"):
            ratio = statistics.median(b / a for b, a in zip(times["bare"], times[key], strict=True))
            label = f"{key:>2} clients" if key != "minimal" else "minimal actor, 16"
            line += f" | {label} {min(times[key]) / cycles * 1e6:5.1f} us, {ratio:.2f}x bare"
        print(line + ("  (target >= 0.7x at 16)" if name == "uvloop" else ""))
    print("\nReproduce: python benchmarks/bench_actor.py  (figures vary 10-20% run to run)")


if __name__ == "__main__":
    main()
