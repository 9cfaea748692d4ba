"""A toy continuous-batching scheduler on asyncio that embeds the kvpool actor.

Requests share a few system prompts, so their leading blocks hit the prefix cache. Each
step the scheduler admits waiting requests in FIFO order while they fit (one ``admit``
per request: prefix reuse, fresh blocks and one spare block for decoding, atomically),
publishes their prompt blocks to the cache, runs a decode step, and frees finished
requests leaf first. A router task scores prefixes on the same pool concurrently.

Run:  python examples/scheduler_loop.py [--requests 200] [--capacity 256] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import deque
from dataclasses import dataclass, field

from kvpool import open_pool
from kvpool.actors import PoolClient


@dataclass
class Request:
    """One request: its prompt's block hashes and how many decode steps it runs."""

    name: str
    chain: list[int]
    decode_steps: int
    blocks: list[int] = field(default_factory=list)


@dataclass
class Report:
    """What a run did."""

    finished: int = 0
    steps: int = 0
    prompt_blocks: int = 0
    cached_blocks: int = 0
    router_lookups: int = 0
    peak_active: int = 0


def make_requests(count: int, rng: random.Random) -> list[Request]:
    system_prompts = [[rng.getrandbits(64) for _ in range(8)] for _ in range(4)]
    requests = []
    for index in range(count):
        shared = rng.choice(system_prompts)[: rng.randint(2, 8)]
        own = [rng.getrandbits(64) for _ in range(rng.randint(1, 8))]
        requests.append(Request(f"req-{index}", shared + own, rng.randint(1, 6)))
    return requests


async def schedule(pool: PoolClient, requests: list[Request], max_running: int) -> Report:
    report = Report()
    waiting = deque(requests)
    running: list[Request] = []
    while waiting or running:
        while waiting and len(running) < max_running:
            request = waiting[0]
            admission = await pool.admit(request.chain, extra=1)
            if admission is None:
                break  # FIFO: the head waits for capacity, nobody overtakes it
            waiting.popleft()
            request.blocks = admission.blocks
            report.prompt_blocks += len(request.chain)
            report.cached_blocks += admission.cached
            fresh = admission.blocks[admission.cached : len(request.chain)]
            await pool.cache_many(list(zip(fresh, request.chain[admission.cached :], strict=True)))
            running.append(request)
        stats = await pool.stats()
        report.peak_active = max(report.peak_active, stats.num_active)
        await asyncio.sleep(0)  # the model step
        report.steps += 1
        for request in list(running):
            request.decode_steps -= 1
            if request.decode_steps == 0:
                running.remove(request)
                await pool.free(request.blocks)
                report.finished += 1
    return report


async def route(pool: PoolClient, requests: list[Request], report: Report) -> None:
    """A router scoring each request's cached prefix, concurrently with the scheduler."""
    for request in requests:
        for block_hash in request.chain:
            report.router_lookups += 1
            if await pool.prefix_hit(block_hash) is None:
                break


async def run(count: int, capacity: int, seed: int) -> tuple[Report, int, int]:
    """Run the scheduler; returns the report and the pool's final (active, refs)."""
    requests = make_requests(count, random.Random(seed))
    async with open_pool(capacity) as pool:
        router_report = Report()
        router = asyncio.create_task(route(pool, requests, router_report))
        report = await schedule(pool, requests, max_running=16)
        await router
        report.router_lookups = router_report.router_lookups
        await pool.check_invariants()
        stats = await pool.stats()
    return report, stats.num_active, stats.num_active_refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    report, active, refs = asyncio.run(run(args.requests, args.capacity, args.seed))
    hit_rate = report.cached_blocks / max(report.prompt_blocks, 1)
    print(
        f"finished {report.finished} of {args.requests} requests in {report.steps} steps; "
        f"prefix-cache hit rate {hit_rate:.0%} of prompt blocks; "
        f"peak {report.peak_active}/{args.capacity} blocks; "
        f"router lookups {report.router_lookups}"
    )
    print(f"final: num_active={active} num_active_refs={refs}")
    return 0 if report.finished == args.requests and (active, refs) == (0, 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
