"""Every BlockPool scenario through the actor, one call at a time: the same answers.

A bare BlockPool and the pool actor sit behind one async interface. Both return the same
shapes, with block ids and reservations replaced by the order in which each side first
handed them out, so two transcripts compare with ``==``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from kvpool.actors import PoolClient, open_pool
from kvpool.errors import PoolError
from kvpool.pool import BlockPool


class BareSide:
    """Drives a BlockPool directly (wrapped in coroutines)."""

    def __init__(self, capacity: int) -> None:
        self.pool = BlockPool(capacity)

    async def prefix_hit(self, block_hash: Any) -> Any:
        return self.pool.prefix_hit(block_hash)

    async def reserve(self, prefix: Any, fresh: Any) -> Any:
        return self.pool.reserve(prefix, fresh)

    async def activate_prefix(self, reservation: Any) -> Any:
        return self.pool.activate_prefix(reservation)

    async def allocate_private(self, reservation: Any) -> Any:
        return self.pool.allocate_private(reservation)

    async def allocate_cached(self, reservation: Any, block_hash: Any) -> Any:
        return self.pool.allocate_cached(reservation, block_hash)

    async def cache_private(self, block_id: Any, block_hash: Any) -> Any:
        return self.pool.cache_private(block_id, block_hash)

    async def release(self, block_id: Any) -> Any:
        return self.pool.release(block_id)

    async def cancel(self, reservation: Any) -> Any:
        return self.pool.cancel(reservation)

    async def counts(self) -> tuple[int, int, int]:
        pool = self.pool
        return pool.num_active(), pool.num_inactive(), pool.num_active_refs()

    async def check_invariants(self) -> None:
        self.pool.check_invariants()


class ActorSide:
    """Drives the pool actor through its client."""

    def __init__(self, client: PoolClient) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def counts(self) -> tuple[int, int, int]:
        stats = await self.client.stats()
        return stats.num_active, stats.num_inactive, stats.num_active_refs


class Transcript:
    """Records results with ids and reservations normalized to first-seen order."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self.block_ids: list[Any] = []
        self.reservations: list[Any] = []

    def name_block(self, block_id: Any) -> int:
        for index, known in enumerate(self.block_ids):
            if known == block_id:
                return index
        self.block_ids.append(block_id)
        return len(self.block_ids) - 1

    def normalize(self, result: Any) -> Any:
        if result is None or isinstance(result, bool):
            return result
        if hasattr(result, "is_active"):
            return ("hit", result.is_active)
        if hasattr(result, "reservation"):
            reservation = result.reservation
            self.reservations.append(reservation)
            return (
                "reserved",
                len(self.reservations) - 1,
                len(reservation),
                reservation.prefix_len,
                reservation.fresh,
                list(result.removed),
            )
        if isinstance(result, tuple):
            return ("cached", self.name_block(result[0]), result[1])
        if isinstance(result, list):
            return ["block", *[self.name_block(b) for b in result]]
        if isinstance(result, int):
            return ("block", self.name_block(result))
        raise AssertionError(f"unexpected result {result!r}")

    async def record(self, label: str, call: Any) -> Any:
        try:
            result = await call
        except PoolError as exc:
            self.entries.append((label, type(exc).__name__))
            return None
        self.entries.append((label, self.normalize(result)))
        return result


async def random_session(side: Any, seed: int, steps: int, capacity: int) -> list[Any]:
    """A seeded random mix of valid calls and mistakes; the transcript of answers."""
    rng = random.Random(seed)
    log = Transcript()
    hashes = list(range(12))
    for step in range(steps):
        op = rng.choice(
            ["hit", "reserve", "reserve", "activate", "private", "private", "cached",
             "cache", "cache", "release", "release", "cancel", "counts"]
        )  # fmt: skip
        reservation = rng.choice(log.reservations) if log.reservations else None
        block = rng.choice(log.block_ids) if log.block_ids else None
        if op == "hit":
            await log.record(op, side.prefix_hit(rng.choice([*hashes, -1])))
        elif op == "reserve":
            resident = [h for h in hashes if (await side.prefix_hit(h)) is not None]
            prefix: Sequence[Any] = rng.sample(resident, k=rng.randint(0, min(3, len(resident))))
            if rng.random() < 0.1:
                prefix = [*prefix, rng.choice([99, "x"])]  # a mistake: not resident / bad
            await log.record(op, side.reserve(prefix, rng.randint(0, capacity // 2)))
        elif op == "activate" and reservation is not None:
            await log.record(op, side.activate_prefix(reservation))
        elif op == "private" and reservation is not None:
            await log.record(op, side.allocate_private(reservation))
        elif op == "cached" and reservation is not None:
            await log.record(op, side.allocate_cached(reservation, rng.choice(hashes)))
        elif op == "cache" and block is not None:
            await log.record(op, side.cache_private(block, rng.choice([*hashes, 2**64])))
        elif op == "release" and block is not None:
            await log.record(op, side.release(block))
        elif op == "cancel" and reservation is not None:
            await log.record(op, side.cancel(reservation))
        elif op == "counts" or step % 16 == 0:
            log.entries.append(("counts", await side.counts()))
    # Wind down: release everything still referenced, cancel every reservation.
    for reservation in log.reservations:
        await log.record("final cancel", side.cancel(reservation))
    for block in reversed(log.block_ids):
        for _ in range(4):
            await log.record("final release", side.release(block))
    log.entries.append(("counts", await side.counts()))
    await side.check_invariants()
    return log.entries


# ------------------------------------------------------------ differential sessions


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(6))
async def test_random_sessions_give_the_bare_pools_answers(seed: int) -> None:
    bare = await random_session(BareSide(8), seed, steps=150, capacity=8)
    async with open_pool(8) as pool:
        through_actor = await random_session(ActorSide(pool), seed, steps=150, capacity=8)
    assert through_actor == bare
    kinds = {entry[1] for entry in bare if isinstance(entry[1], str)}
    assert kinds, "the session should include caller mistakes"


# ------------------------------------------- the reference's scenarios, on both sides


async def _duplicate_hashes(side: Any, log: Transcript) -> None:
    first = (await side.reserve([], 1)).reservation
    first_id = await side.allocate_private(first)
    assert await side.cache_private(first_id, 7) is True
    second = (await side.reserve([], 1)).reservation
    second_id = await side.allocate_private(second)
    assert await side.cache_private(second_id, 7) is False
    assert (await side.counts())[0] == 2
    await side.release(first_id)
    await side.release(second_id)
    assert (await side.counts())[1] == 2
    log.entries.append(await side.counts())


async def _prefix_pin_excluded(side: Any, log: Transcript) -> None:
    seed = (await side.reserve([], 1)).reservation
    block = await side.allocate_private(seed)
    assert await side.cache_private(block, 9)
    await side.release(block)
    assert await side.reserve([9], 1) is None
    assert await side.counts() == (0, 1, 0)
    log.entries.append(await side.counts())


async def _removal_only_for_last_copy(side: Any, log: Transcript) -> None:
    ids = []
    for _ in range(2):
        reservation = (await side.reserve([], 1)).reservation
        ids.append(await side.allocate_private(reservation))
        await side.cancel(reservation)
    assert await side.cache_private(ids[0], 3) is True
    assert await side.cache_private(ids[1], 3) is False
    for block in ids:
        await side.release(block)
    first = await side.reserve([], 1)
    assert first.removed == []
    await side.cancel(first.reservation)
    second = await side.reserve([], 2)
    assert second.removed == [3]
    await side.cancel(second.reservation)
    log.entries.append(await side.counts())


async def _leaf_before_parent(side: Any, log: Transcript) -> None:
    seed = (await side.reserve([], 2)).reservation
    parent = await side.allocate_private(seed)
    leaf = await side.allocate_private(seed)
    assert await side.cache_private(parent, 7)
    assert await side.cache_private(leaf, 8)
    await side.release(leaf)
    await side.release(parent)
    cancelled = await side.reserve([7, 8], 0)
    assert cancelled.removed == []
    await side.cancel(cancelled.reservation)
    pressure = await side.reserve([], 1)
    assert pressure.removed == [8]
    assert await side.prefix_hit(7) is not None
    assert await side.prefix_hit(8) is None
    await side.cancel(pressure.reservation)
    await side.cancel(seed)
    log.entries.append(await side.counts())


async def _middle_pin_keeps_lru_order(side: Any, log: Transcript) -> None:
    seed = (await side.reserve([], 3)).reservation
    ids = [await side.allocate_private(seed) for _ in range(3)]
    for block, block_hash in zip(ids, [1, 2, 3], strict=True):
        assert await side.cache_private(block, block_hash)
    for block in ids:
        await side.release(block)
    pinned = await side.reserve([2], 1)
    assert pinned.removed == [1]
    await side.cancel(pinned.reservation)
    pressure = await side.reserve([], 2)
    assert pressure.removed == [3]
    await side.cancel(pressure.reservation)
    await side.check_invariants()
    log.entries.append(await side.counts())


async def _activated_prefix_reenters_lru(side: Any, log: Transcript) -> None:
    seed = (await side.reserve([], 1)).reservation
    block = await side.allocate_private(seed)
    assert await side.cache_private(block, 7)
    await side.release(block)
    activation = (await side.reserve([7], 0)).reservation
    assert await side.activate_prefix(activation) == [block]
    await side.cancel(activation)
    assert (await side.counts())[1] == 0
    await side.release(block)
    assert (await side.counts())[1] == 1
    pressure = await side.reserve([], 1)
    assert pressure.removed == [7]
    await side.cancel(pressure.reservation)
    log.entries.append(await side.counts())


async def _allocate_cached_and_exhaustion(side: Any, log: Transcript) -> None:
    reservation = (await side.reserve([], 2)).reservation
    first = await log.record("cached", side.allocate_cached(reservation, 5))
    await log.record("cached again", side.allocate_cached(reservation, 5))
    await log.record("exhausted", side.allocate_private(reservation))
    await log.record("cancel", side.cancel(reservation))
    await log.record("closed", side.allocate_private(reservation))
    await log.record("cancel twice", side.cancel(reservation))
    await log.record("already cached", side.cache_private(first[0], 6))
    log.entries.append(await side.counts())


SCENARIOS = [
    _duplicate_hashes,
    _prefix_pin_excluded,
    _removal_only_for_last_copy,
    _leaf_before_parent,
    _middle_pin_keeps_lru_order,
    _activated_prefix_reenters_lru,
    _allocate_cached_and_exhaustion,
]
CAPACITY = {_prefix_pin_excluded: 1, _activated_prefix_reenters_lru: 1}


@pytest.mark.anyio
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__.strip("_"))
async def test_reference_scenario_gives_the_same_answers(scenario: Any) -> None:
    capacity = CAPACITY.get(scenario, 3 if scenario is _middle_pin_keeps_lru_order else 2)
    bare_log = Transcript()
    await scenario(BareSide(capacity), bare_log)
    actor_log = Transcript()
    async with open_pool(capacity) as pool:
        await scenario(ActorSide(pool), actor_log)
        await pool.check_invariants()
    assert actor_log.entries == bare_log.entries
