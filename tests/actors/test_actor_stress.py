"""Stress: thousands of tasks run admit / lease / reservation lifecycles (partial use,
cache, free) through one actor, with random deadlines and a cancellation landing at a
random await. Whatever got interrupted, nothing may leak: afterwards no block is held,
the pool's invariants hold, and every task finished."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable
from typing import Any

import anyio
import pytest
import uvloop

from kvpool.actors import ActorReservation, PoolClient, PoolState, open_pool
from kvpool.errors import PrefixNotResidentError

TASKS = 5000
CAPACITY = 96
HANG_GUARD = 120  # seconds; a guard against hangs, never a timing assertion


class Lifecycle:
    """One task's run: every await goes through `step`, which may cancel before it."""

    def __init__(self, pool: PoolClient, rng: random.Random) -> None:
        self.pool = pool
        self.rng = rng
        self.cancel_at = rng.randrange(12) if rng.random() < 0.5 else None
        self.awaits = 0
        self.owned: list[Any] = []  # block ids this task holds a reference to
        self.reservation: ActorReservation | None = None
        self.scope = anyio.CancelScope()

    async def step(self, awaitable: Awaitable[Any]) -> Any:
        if self.awaits == self.cancel_at:
            self.scope.cancel()
        self.awaits += 1
        return await awaitable

    def chain(self) -> list[int]:
        # Chains share prefixes (a few roots) so admits hit, duplicate and evict.
        root = self.rng.randrange(6) * 1000
        return [root + k for k in range(self.rng.randint(1, 12))]

    async def run(self) -> bool:
        """Run the lifecycle; True if a deadline or a cancellation cut it short."""
        deadline = self.rng.choice([math.inf, math.inf, 0, 1e-4, 1e-3, 1e-2])
        try:
            with self.scope, anyio.move_on_after(deadline) as deadline_scope:
                for _ in range(self.rng.randint(1, 3)):
                    roll = self.rng.random()
                    if roll < 0.5:
                        await self.admit_path()
                    elif roll < 0.75:
                        await self.lease_path()
                    else:
                        await self.reservation_path()
        finally:
            await self.give_everything_back()
        return self.scope.cancel_called or deadline_scope.cancelled_caught

    async def admit_path(self) -> None:
        chain = self.chain()
        extra = self.rng.randint(0, 3)
        admission = await self.step(self.pool.admit(chain, extra, wait=self.rng.random() < 0.5))
        if admission is None:
            return
        self.owned = list(admission.blocks)  # owned the moment the reply is read
        fresh = self.owned[admission.cached : len(chain)]
        used = self.rng.randint(0, len(fresh))  # partial use: cache only a prefix
        pairs = list(zip(fresh[:used], chain[admission.cached :], strict=False))
        await self.step(self.pool.cache_many(pairs))
        if self.rng.random() < 0.5:
            tail = self.rng.randint(0, len(self.owned))
            released = self.owned[len(self.owned) - tail :]
            del self.owned[len(self.owned) - tail :]
            await self.step(self.pool.free(released))
        await self.step(anyio.sleep(0))
        released, self.owned = self.owned, []
        await self.step(self.pool.free(released))

    async def lease_path(self) -> None:
        """A lease frees whatever it still holds on any exit, cancelled or not."""
        chain = self.chain()
        wait = self.rng.random() < 0.5
        async with self.pool.lease(chain, self.rng.randint(0, 2), wait=wait) as lease:
            if lease is None:
                return
            cached = lease.admission.cached
            pairs = list(zip(lease.blocks[cached : len(chain)], chain[cached:], strict=False))
            await self.step(self.pool.cache_many(pairs[: self.rng.randint(0, len(pairs))]))
            if self.rng.random() < 0.5:
                await self.step(lease.free(self.rng.randint(0, len(lease.blocks))))
            await self.step(anyio.sleep(self.rng.choice([0, 1e-4])))

    async def reservation_path(self) -> None:
        resident = []
        for block_hash in self.chain():
            if await self.step(self.pool.prefix_hit(block_hash)) is None:
                break
            resident.append(block_hash)
        try:
            outcome = await self.step(self.pool.reserve(resident, self.rng.randint(0, 4)))
        except PrefixNotResidentError:
            return  # evicted between the lookup and the reserve: separate calls race
        if outcome is None:
            return
        self.reservation = outcome.reservation
        self.owned += await self.step(self.pool.activate_prefix(outcome.reservation))
        for _ in range(self.rng.randint(0, outcome.reservation.fresh)):
            if self.rng.random() < 0.3:
                block, _visible = await self.step(
                    self.pool.allocate_cached(outcome.reservation, self.rng.randrange(6) * 1000)
                )
            else:
                block = await self.step(self.pool.allocate_private(outcome.reservation))
            self.owned.append(block)
        self.reservation = None
        await self.step(self.pool.cancel(outcome.reservation))
        released, self.owned = self.owned, []
        await self.step(self.pool.free(released))

    async def give_everything_back(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.reservation is not None and not self.reservation.closed:
                await self.pool.cancel(self.reservation)
            if self.owned:
                await self.pool.free(self.owned)


@pytest.mark.slow
@pytest.mark.anyio
async def test_thousands_of_interrupted_lifecycles_leak_nothing() -> None:
    rng = random.Random(20261129)
    finished = 0
    interrupted = [0]
    with anyio.fail_after(HANG_GUARD):
        async with open_pool(CAPACITY) as pool:

            async def one(seed: int) -> None:
                nonlocal finished
                cut_short = await Lifecycle(pool, random.Random(seed)).run()
                interrupted[0] += cut_short
                finished += 1

            async def checker() -> None:
                while finished < TASKS:
                    await pool.check_invariants()
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(checker)
                for _ in range(TASKS):
                    tg.start_soon(one, rng.getrandbits(32))
            assert finished == TASKS
            stats = await pool.stats()
            assert (stats.num_active, stats.num_active_refs, stats.waiters) == (0, 0, 0)
            await pool.check_invariants()
            # The run really exercised the pool: admissions, evictions, refusals.
            assert stats.reserves > TASKS // 10
            assert 0 < interrupted[0] < TASKS
            assert stats.evictions > 0
            assert stats.reserve_failures > 0


# ------------------- plain asyncio cancellation: it can land on a reply not yet read


async def _asyncio_worker(pool: PoolClient, rng: random.Random) -> None:
    owned: list[Any] = []
    reservation: ActorReservation | None = None
    try:
        async with asyncio.timeout(rng.choice([None, 0, 1e-5, 1e-4, 1e-3])):
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.5:
                    root = rng.randrange(4) * 100
                    chain = [root + k for k in range(rng.randint(1, 8))]
                    admission = await pool.admit(chain, rng.randint(0, 2), wait=rng.random() < 0.5)
                    if admission is None:
                        continue
                    owned = list(admission.blocks)
                    fresh = owned[admission.cached : len(chain)]
                    await pool.cache_many(list(zip(fresh, chain[admission.cached :], strict=True)))
                else:
                    outcome = await pool.reserve([], rng.randint(0, 3))
                    if outcome is None:
                        continue
                    reservation = outcome.reservation
                    for _ in range(reservation.fresh):
                        owned.append(await pool.allocate_private(reservation))
                    reservation = None
                    await pool.cancel(outcome.reservation)
                released, owned = owned, []
                await pool.free(released)
    except TimeoutError:
        pass
    finally:  # asyncio's shield: the give-back completes even if this task is cancelled
        if reservation is not None and not reservation.closed:
            await asyncio.shield(pool.cancel(reservation))
        if owned:
            await asyncio.shield(pool.free(owned))


@pytest.mark.parametrize(
    "run", [pytest.param(asyncio.run, id="asyncio"), pytest.param(uvloop.run, id="uvloop")]
)
def test_asyncio_timeouts_and_task_cancels_leak_nothing(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    undone: list[str] = []
    for name in ["undo_admit", "undo_reserve", "undo_allocate"]:
        original = getattr(PoolState, name)

        def spy(self: PoolState, message: Any, reply: Any, original: Any = original) -> None:
            undone.append(type(message).__name__)
            original(self, message, reply)

        monkeypatch.setattr(PoolState, name, spy)

    async def scenario() -> None:
        rng = random.Random(7)
        async with open_pool(64) as pool:
            tasks = [
                asyncio.create_task(_asyncio_worker(pool, random.Random(rng.random())))
                for _ in range(2000)
            ]
            for task in rng.sample(tasks, 300):  # cancelled from outside, at any point
                task.cancel()
            async with asyncio.timeout(HANG_GUARD):
                results = await asyncio.gather(*tasks, return_exceptions=True)
            unexpected = [r for r in results if isinstance(r, BaseException)]
            assert all(isinstance(r, asyncio.CancelledError) for r in unexpected), unexpected
            stats = await pool.stats()
            assert (stats.num_active, stats.num_active_refs, stats.waiters) == (0, 0, 0)
            await pool.check_invariants()

    run(scenario())
    assert undone, "no cancellation landed between a reply and its reading"
