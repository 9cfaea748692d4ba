"""The extension API: other layers plug their own state and message kinds into an actor."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import msgspec
import pytest
import uvloop

from kvpool.actors import WAIT, Handler, PoolState, Wait, open_actor, open_pool
from kvpool.errors import ActorClosedError, CapacityError, InvalidArgumentError
from kvpool.messages import GetStats


class Touch(msgspec.Struct, frozen=True, tag=True):
    """Take a reference to the resident copy of ``block_hash`` (the docstring's example)."""

    block_hash: int


class Touched(msgspec.Struct, frozen=True, tag=True):
    ids: list[int]


def touch_extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
    pool = state.pool

    def touch(message: Touch) -> Touched:
        if pool.prefix_hit(message.block_hash) is None:
            raise CapacityError(f"{message.block_hash} is not resident")
        outcome = pool.reserve([message.block_hash], 0)
        assert outcome is not None  # fresh=0 always fits: the pool counts the reserve
        ids = pool.activate_prefix(outcome.reservation)
        pool.cancel(outcome.reservation)
        return Touched(ids)

    def untouch(message: Touch, reply: Touched) -> None:
        for block_id in reversed(reply.ids):
            pool.release(block_id)  # type: ignore[arg-type]

    return {Touch: Handler(touch, undo=untouch)}


@pytest.mark.anyio
async def test_an_extension_runs_in_the_pools_actor_with_its_stats() -> None:
    async with open_pool(4, extensions=[touch_extension]) as pool:
        seed = await pool.admit([5])
        assert seed is not None
        await pool.cache_many([(seed.blocks[0], 5)])
        await pool.free(seed.blocks)
        reply = await pool.call(Touch(5))
        assert reply == Touched(seed.blocks)
        stats = await pool.stats()
        assert (stats.num_active, stats.num_active_refs, stats.reserves) == (1, 1, 2)
        with pytest.raises(CapacityError):  # a refusal reaches the caller; actor lives on
            await pool.call(Touch(6))
        await pool.free(reply.ids)
        assert (await pool.stats()).num_active == 0


@pytest.mark.parametrize(
    "run", [pytest.param(asyncio.run, id="asyncio"), pytest.param(uvloop.run, id="uvloop")]
)
def test_an_extensions_unread_reply_is_undone(run: Any) -> None:
    async def scenario() -> None:
        async with open_pool(4, extensions=[touch_extension]) as pool:
            seed = await pool.admit([5])
            assert seed is not None
            await pool.cache_many([(seed.blocks[0], 5)])
            await pool.free(seed.blocks)
            for delay in range(5):
                task = asyncio.get_running_loop().create_task(pool.call(Touch(5)))
                for _ in range(delay):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    reply = await task
                except asyncio.CancelledError:
                    pass
                else:
                    await pool.free(reply.ids)
                stats = await pool.stats()
                assert (stats.num_active, stats.num_active_refs) == (0, 0)

    run(scenario())


@pytest.mark.anyio
async def test_a_kind_registered_twice_is_refused_at_open() -> None:
    with pytest.raises(InvalidArgumentError, match="registered twice"):
        async with open_pool(4, extensions=[touch_extension, touch_extension]):
            pass
    with pytest.raises(InvalidArgumentError, match="registered twice"):
        async with open_pool(4, extensions=[lambda state: {GetStats: Handler(print)}]):
            pass


# ------------------------------------------ a bare actor over any state: a semaphore


class Acquire(msgspec.Struct, frozen=True, tag=True):
    units: int


class Give(msgspec.Struct, frozen=True, tag=True):
    units: int


class Units(msgspec.Struct, frozen=True, tag=True):
    free: int


class Semaphore:
    """A toy state: units handed out FIFO, given back, undone when never read."""

    def __init__(self, units: int) -> None:
        self.free = units

    def acquire(self, message: Acquire) -> Units | Wait:
        if message.units > self.free:
            return WAIT
        self.free -= message.units
        return Units(self.free)

    def give(self, message: Give) -> Units:
        self.free += message.units
        return Units(self.free)

    def undo_acquire(self, message: Acquire, reply: Units) -> None:
        self.free += message.units

    def handlers(self) -> dict[type, Handler[Any, Any]]:
        return {
            Acquire: Handler(self.acquire, undo=self.undo_acquire, waits=lambda m: True),
            Give: Handler(self.give, gives_back=True),
        }


@pytest.mark.anyio
async def test_open_actor_serves_any_state_with_fifo_waiters() -> None:
    semaphore = Semaphore(3)
    granted: list[int] = []
    async with open_actor(semaphore.handlers()) as actor:
        await actor.call(Acquire(3))

        async def want(units: int) -> None:
            await actor.call(Acquire(units))
            granted.append(units)

        async with anyio.create_task_group() as tg:
            tg.start_soon(want, 2)
            while actor.num_waiters < 1:
                await anyio.lowlevel.checkpoint()
            tg.start_soon(want, 1)
            while actor.num_waiters < 2:
                await anyio.lowlevel.checkpoint()
            assert (await actor.call(Give(1))).free == 1  # 1 free: the head (2) waits
            assert granted == []
            await actor.call(Give(2))  # 3 free: both granted, head first
        assert sorted(granted) == [1, 2]
        assert semaphore.free == 0
        with anyio.CancelScope() as scope:  # a waiter cancelled leaves no trace
            scope.cancel()
            await actor.call(Acquire(1))
        assert semaphore.free == 0
        await actor.call(Give(3))
        assert semaphore.free == 3
        assert actor.num_waiters == 0
    with pytest.raises(ActorClosedError):
        await actor.call(Give(1))
