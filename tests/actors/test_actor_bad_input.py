"""Bad input through the actor: the caller gets BlockPool's typed error, nothing changes,
and the actor keeps serving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvpool import errors
from kvpool.actors import PoolClient, open_pool
from kvpool.pool import BlockPool

MAX = (1 << 64) - 1


@dataclass
class World:
    """The same small state on either side: what a bad call is tried against."""

    side: Any
    private: Any  # a private block
    cached: Any  # an active cached block (hash 3)
    idle: Any  # an inactive cached block (hash 1)
    open: Any  # a reservation: prefix [2], fresh 1
    spent: Any  # a reservation with nothing fresh left
    closed: Any  # a cancelled reservation


class Bare:
    def __init__(self) -> None:
        self.pool = BlockPool(8)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.pool, name)

        async def call(*args: Any) -> Any:
            return method(*args)

        return call


async def build(side: Any) -> World:
    seed = (await side.reserve([], 4)).reservation
    idle = await side.allocate_private(seed)
    second = await side.allocate_private(seed)
    private = await side.allocate_private(seed)
    cached = await side.allocate_private(seed)
    await side.cache_private(idle, 1)
    await side.cache_private(second, 2)
    await side.cache_private(cached, 3)
    await side.release(idle)
    await side.release(second)
    spent = seed
    open_ = (await side.reserve([2], 1)).reservation
    closed = (await side.reserve([], 1)).reservation
    await side.cancel(closed)
    return World(side, private, cached, idle, open_, spent, closed)


BAD_CALLS: dict[str, Any] = {
    "prefix_hit negative": lambda w: w.side.prefix_hit(-1),
    "prefix_hit too big": lambda w: w.side.prefix_hit(MAX + 1),
    "prefix_hit str": lambda w: w.side.prefix_hit("1"),
    "prefix_hit bool": lambda w: w.side.prefix_hit(True),
    "reserve str prefix": lambda w: w.side.reserve("12", 1),
    "reserve None prefix": lambda w: w.side.reserve(None, 1),
    "reserve negative fresh": lambda w: w.side.reserve([], -1),
    "reserve float fresh": lambda w: w.side.reserve([], 1.0),
    "reserve not resident": lambda w: w.side.reserve([1, 99], 1),
    "reserve bad hash": lambda w: w.side.reserve([1, -5], 0),
    "activate closed": lambda w: w.side.activate_prefix(w.closed),
    "activate garbage": lambda w: w.side.activate_prefix(object()),
    "private closed": lambda w: w.side.allocate_private(w.closed),
    "private exhausted": lambda w: w.side.allocate_private(w.spent),
    "cached bad hash": lambda w: w.side.allocate_cached(w.open, -1),
    "cached exhausted": lambda w: w.side.allocate_cached(w.spent, 5),
    "cache unknown block": lambda w: w.side.cache_private(12345, 5),
    "cache already cached": lambda w: w.side.cache_private(w.cached, 5),
    "cache bad hash": lambda w: w.side.cache_private(w.private, MAX + 1),
    "release unknown": lambda w: w.side.release(12345),  # ids are opaque: none is this
    "release str": lambda w: w.side.release("x"),
    "release unreferenced": lambda w: w.side.release(w.idle),
    "cancel twice": lambda w: w.side.cancel(w.closed),
    "cancel garbage": lambda w: w.side.cancel(None),
}


async def snapshot(pool: PoolClient) -> tuple[Any, ...]:
    stats = await pool.stats()
    hits = [await pool.prefix_hit(h) for h in range(8)]
    await pool.check_invariants()
    return stats, hits


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(BAD_CALLS))
async def test_a_bad_call_raises_the_pools_error_and_changes_nothing(name: str) -> None:
    bare_world = await build(Bare())
    with pytest.raises(errors.PoolError) as bare_error:
        await BAD_CALLS[name](bare_world)
    async with open_pool(8) as pool:
        world = await build(pool)
        before = await snapshot(pool)
        with pytest.raises(errors.PoolError) as actor_error:
            await BAD_CALLS[name](world)
        assert type(actor_error.value) is type(bare_error.value)
        assert await snapshot(pool) == before
        # Still serving, and the world still works as before.
        assert await pool.allocate_private(world.open) is not None


@pytest.mark.anyio
async def test_a_reservation_of_another_pool_or_the_cores_type_is_foreign() -> None:
    async with open_pool(4) as pool, open_pool(4) as other:
        theirs = await other.reserve([], 1)
        assert theirs is not None
        core_reservation = BlockPool(2).reserve([], 1)
        assert core_reservation is not None
        before = await snapshot(pool)
        for reservation in [theirs.reservation, core_reservation.reservation, 7]:
            for call in [pool.activate_prefix, pool.allocate_private, pool.cancel]:
                with pytest.raises(errors.ForeignReservationError):
                    await call(reservation)  # type: ignore[operator]
        assert await snapshot(pool) == before
        assert (await other.stats()).num_active == 1


BAD_ADMITS: dict[str, tuple[Any, Any, type[errors.PoolError]]] = {
    "chain str": ("abc", 0, errors.InvalidArgumentError),
    "chain None": (None, 0, errors.InvalidArgumentError),
    "chain bad hash": ([1, "x"], 0, errors.InvalidHashError),
    "chain negative hash": ([-1], 0, errors.InvalidHashError),
    "chain too big hash": ([MAX + 1], 0, errors.InvalidHashError),
    "extra negative": ([1], -1, errors.InvalidArgumentError),
    "extra float": ([1], 0.5, errors.InvalidArgumentError),
    "larger than the pool": ([1, 2, 3, 4, 5, 6, 7], 2, errors.CapacityError),
}


@pytest.mark.anyio
@pytest.mark.parametrize("wait", [False, True])
@pytest.mark.parametrize("name", list(BAD_ADMITS))
async def test_a_bad_admit_raises_and_changes_nothing(name: str, wait: bool) -> None:
    chain, extra, error = BAD_ADMITS[name]
    async with open_pool(8) as pool:
        await build(pool)
        before = await snapshot(pool)
        with pytest.raises(error):
            await pool.admit(chain, extra, wait=wait)
        assert await snapshot(pool) == before


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("unknown id", errors.UnknownBlockError),
        ("already cached", errors.AlreadyCachedError),
        ("same block twice", errors.AlreadyCachedError),
        ("bad hash", errors.InvalidHashError),
        ("not a pair", errors.InvalidArgumentError),
    ],
)
async def test_cache_many_with_one_bad_pair_caches_nothing(name: str, error: type) -> None:
    async with open_pool(8) as pool:
        world = await build(pool)
        admission = await pool.admit([], 2)
        assert admission is not None
        first, second = admission.blocks
        bad = {
            "unknown id": (first + 99, 50),
            "already cached": (world.cached, 50),
            "same block twice": (first, 50),
            "bad hash": (second, -3),
            "not a pair": (second,),
        }[name]
        before = await snapshot(pool)
        with pytest.raises(error):
            await pool.cache_many([(first, 40), bad, (second, 41)])  # type: ignore[list-item]
        assert await snapshot(pool) == before
        assert await pool.prefix_hit(40) is None
        assert await pool.cache_many([(first, 40), (second, 41)]) == [True, True]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("unknown id", errors.UnknownBlockError),
        ("private twice", errors.BlockNotReferencedError),
        ("idle cached", errors.BlockNotReferencedError),
        ("a string", errors.UnknownBlockError),
    ],
)
async def test_free_with_one_bad_id_releases_nothing(name: str, error: type) -> None:
    async with open_pool(8) as pool:
        world = await build(pool)
        admission = await pool.admit([], 2)
        assert admission is not None
        first, second = admission.blocks
        bad = {
            "unknown id": [first, first + 99, second],
            "private twice": [first, second, first],
            "idle cached": [first, world.idle, second],
            "a string": [first, "x", second],
        }[name]
        before = await snapshot(pool)
        with pytest.raises(error):
            await pool.free(bad)
        assert await snapshot(pool) == before
        await pool.free([first, second])
        assert (await pool.stats()).num_active == before[0].num_active - 2


@pytest.mark.anyio
async def test_free_or_cache_many_of_a_non_sequence_is_an_invalid_argument() -> None:
    async with open_pool(4) as pool:
        for bad in [None, "ab", 5, {1: 2}]:
            with pytest.raises(errors.InvalidArgumentError):
                await pool.free(bad)  # type: ignore[arg-type]
            with pytest.raises(errors.InvalidArgumentError):
                await pool.cache_many(bad)  # type: ignore[arg-type]
        for bad_pairs in [[(3,), (1, 2)], [(1, 2, 3), (4, 5, 6)], [1, 2], ["ab"]]:
            with pytest.raises(errors.InvalidArgumentError):
                await pool.cache_many(bad_pairs)  # type: ignore[arg-type]
        assert await pool.cache_many([]) == []
        assert (await pool.stats()).num_active == 0


@pytest.mark.anyio
async def test_free_releases_a_shared_block_as_often_as_it_is_referenced() -> None:
    async with open_pool(4) as pool:
        admission = await pool.admit([], 1)
        assert admission is not None
        await pool.cache_many([(admission.blocks[0], 9)])
        again = await pool.admit([9])
        assert again is not None
        assert again.blocks == admission.blocks
        assert (again.cached, again.active_cached) == (1, 1)
        with pytest.raises(errors.BlockNotReferencedError):
            await pool.free(admission.blocks * 3)
        await pool.free(admission.blocks * 2)
        stats = await pool.stats()
        assert (stats.num_active, stats.num_inactive, stats.num_active_refs) == (0, 1, 0)
