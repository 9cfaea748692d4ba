"""A concurrent stress run: many clients lease, use, cache and free blocks on one pool
actor while a chaos task cancels them at random; at the end nothing may be held.

Run:  python examples/stress_run.py [--clients 500] [--rounds 20] [--capacity 128]
                                    [--backend asyncio|uvloop|trio] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import anyio

from kvpool import open_pool
from kvpool.actors import PoolClient


async def client(pool: PoolClient, rng: random.Random, rounds: int, tally: dict[str, int]) -> None:
    for _ in range(rounds):
        root = rng.randrange(8) * 100
        chain = [root + k for k in range(rng.randint(1, 10))]
        with anyio.move_on_after(rng.choice([1e-4, 1e-3, 1e-2, 1.0])) as scope:
            async with pool.lease(chain, extra=rng.randint(0, 2)) as lease:
                tally["leases"] += 1
                fresh = lease.blocks[lease.admission.cached : len(chain)]
                pairs = list(zip(fresh, chain[lease.admission.cached :], strict=False))
                await pool.cache_many(pairs[: rng.randint(0, len(pairs))])
                await anyio.sleep(rng.choice([0, 0, 1e-4]))
        tally["cut_short"] += scope.cancelled_caught


async def chaos(scope: anyio.CancelScope, rng: random.Random) -> None:
    """Cancels the whole herd of clients at a random moment of a random round."""
    await anyio.sleep(rng.uniform(0, 0.05))
    scope.cancel()


async def run(clients: int, rounds: int, capacity: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = {"leases": 0, "cut_short": 0}
    started = time.perf_counter()
    async with open_pool(capacity) as pool:
        # Two waves: the first is cancelled wholesale by the chaos task, the second runs out.
        for wave in range(2):
            async with anyio.create_task_group() as tg:
                if wave == 0:
                    tg.start_soon(chaos, tg.cancel_scope, random.Random(rng.random()))
                for _ in range(clients):
                    tg.start_soon(client, pool, random.Random(rng.random()), rounds, tally)
        await pool.check_invariants()
        stats = await pool.stats()
    return {
        "leases": tally["leases"],
        "cut_short": tally["cut_short"],
        "seconds": round(time.perf_counter() - started, 3),
        "num_active": stats.num_active,
        "num_active_refs": stats.num_active_refs,
        "evictions": stats.evictions,
        "reserves": stats.reserves,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    backend, options = args.backend, {}
    if backend == "uvloop":
        import uvloop

        backend, options = "asyncio", {"loop_factory": uvloop.new_event_loop}
    result = anyio.run(
        run, args.clients, args.rounds, args.capacity, args.seed,
        backend=backend, backend_options=options,
    )  # fmt: skip
    print(" ".join(f"{key}={value}" for key, value in result.items()))
    return 0 if (result["num_active"], result["num_active_refs"]) == (0, 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
