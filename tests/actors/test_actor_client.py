"""The client's batched calls and context managers: admit, cache_many, free, lease,
reservation, stats."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import kvpool
from kvpool.actors import Lease, PoolClient, open_pool


async def _held(pool: PoolClient) -> tuple[int, int]:
    stats = await pool.stats()
    return stats.num_active, stats.num_active_refs


@pytest.mark.anyio
async def test_open_pool_is_reexported_by_the_package() -> None:
    async with kvpool.open_pool(2) as pool:
        assert pool.capacity == 2


@pytest.mark.anyio
async def test_open_pool_rejects_a_bad_capacity_like_the_core() -> None:
    with pytest.raises(kvpool.InvalidArgumentError):
        async with open_pool(0):
            pass


@pytest.mark.anyio
async def test_admit_reuses_the_resident_prefix_up_to_the_first_miss() -> None:
    async with open_pool(16) as pool:
        first = await pool.admit([1, 2, 3], extra=1)
        assert first is not None
        assert (first.cached, first.active_cached, len(first.blocks)) == (0, 0, 4)
        assert await pool.cache_many(list(zip(first.blocks, [1, 2, 3], strict=False))) == [
            True,
            True,
            True,
        ]
        # 1 and 2 stay active (held by `first`), 3 goes idle, 4 was never cached.
        await pool.release(first.blocks[3])
        await pool.release(first.blocks[2])
        second = await pool.admit([1, 2, 3, 4, 5])
        assert second is not None
        assert second.cached == 3
        assert second.active_cached == 2
        assert second.blocks[:3] == first.blocks[:3]
        assert len(set(second.blocks)) == 5
        gap = await pool.admit([1, 9, 3])  # stops at the first miss, even if 3 is resident
        assert gap is not None
        assert gap.cached == 1
        for admission in [second, gap]:
            await pool.free(admission.blocks)
        await pool.free(first.blocks[:2])
        assert await _held(pool) == (0, 0)
        await pool.check_invariants()


@pytest.mark.anyio
async def test_admit_reports_evictions_and_none_when_it_does_not_fit() -> None:
    async with open_pool(4) as pool:
        old = await pool.admit([1, 2, 3])
        assert old is not None
        await pool.cache_many(list(zip(old.blocks, [1, 2, 3], strict=True)))
        await pool.free(old.blocks)  # leaf first: 3 enters the LRU first
        hold = await pool.admit([], 1)  # the one free slot: no eviction
        assert hold is not None
        assert hold.removed == []
        assert await pool.admit([7], extra=3) is None  # 4 needed, 3 evictable
        new = await pool.admit([7, 8])
        assert new is not None
        assert new.removed == [3, 2]
        stats = await pool.stats()
        # The pool counts every admit that fit (3), the one that did not, and the copies
        # evicted.
        assert (stats.evictions, stats.reserve_failures, stats.reserves) == (2, 1, 3)
        await pool.free([*new.blocks, *hold.blocks])
        assert await _held(pool) == (0, 0)


@pytest.mark.anyio
async def test_a_lease_frees_what_it_still_holds_on_every_exit() -> None:
    async with open_pool(8) as pool:
        async with pool.lease([1, 2], extra=2) as lease:
            assert isinstance(lease, Lease)
            assert len(lease.blocks) == 4
            await lease.free(1)  # the extra tail block, now
            assert len(lease.blocks) == 3
            assert await _held(pool) == (3, 3)
        assert await _held(pool) == (0, 0)

        with pytest.raises(RuntimeError):
            async with pool.lease([3]) as lease:
                raise RuntimeError("boom")
        assert await _held(pool) == (0, 0)

        with anyio.CancelScope() as scope:
            async with pool.lease([4, 5]) as lease:
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert await _held(pool) == (0, 0)

        async with pool.lease([6]) as lease:
            kept = lease.detach()
        assert await _held(pool) == (1, 1)
        await pool.free(kept)
        await pool.check_invariants()


@pytest.mark.anyio
async def test_a_lease_that_does_not_wait_yields_none_when_it_does_not_fit() -> None:
    async with open_pool(2) as pool, pool.lease([1, 2]) as full:
        assert full is not None
        async with pool.lease([3], wait=False) as nothing:
            assert nothing is None


@pytest.mark.anyio
async def test_a_waiting_lease_is_granted_when_another_lease_ends() -> None:
    async with open_pool(2) as pool:
        order: list[str] = []

        async def second() -> None:
            async with pool.lease([3, 4]) as lease:
                order.append("second")
                assert len(lease.blocks) == 2

        async with anyio.create_task_group() as tg, pool.lease([1, 2]):
            tg.start_soon(second)
            while (await pool.stats()).waiters == 0:
                await anyio.lowlevel.checkpoint()
            order.append("first done")
        assert order == ["first done", "second"]
        assert await _held(pool) == (0, 0)


@pytest.mark.anyio
async def test_a_reservation_context_cancels_whatever_is_unconsumed() -> None:
    async with open_pool(8) as pool:
        seed = await pool.admit([1])
        assert seed is not None
        await pool.cache_many([(seed.blocks[0], 1)])
        await pool.free(seed.blocks)
        async with pool.reservation([1], 3) as outcome:
            assert outcome is not None
            reservation = outcome.reservation
            assert (len(reservation), reservation.prefix_len, reservation.fresh) == (4, 1, 3)
            block = await pool.allocate_private(reservation)
            assert reservation.fresh == 2
            assert await _held(pool) == (4, 1)
        assert reservation.closed
        assert await _held(pool) == (1, 1)  # the allocated block is the caller's
        await pool.release(block)

        async with pool.reservation([], 3) as outcome:
            assert outcome is not None
            await pool.cancel(outcome.reservation)  # consumed by hand: exit does nothing
        async with pool.reservation([], 9) as outcome:
            assert outcome is None
        assert await _held(pool) == (0, 0)
        await pool.check_invariants()


@pytest.mark.anyio
async def test_many_tasks_share_one_pool_consistently() -> None:
    async with open_pool(64) as pool:
        results: list[Any] = []

        async def worker(index: int) -> None:
            for round_ in range(20):
                chain = [index * 1000 + round_ * 10 + k for k in range(3)]
                async with pool.lease(chain) as lease:
                    flags = await pool.cache_many(list(zip(lease.blocks, chain, strict=True)))
                    results.append(flags)

        async with anyio.create_task_group() as tg:
            for index in range(16):
                tg.start_soon(worker, index)
        assert len(results) == 16 * 20
        assert all(flags == [True, True, True] for flags in results)
        assert await _held(pool) == (0, 0)
        await pool.check_invariants()
