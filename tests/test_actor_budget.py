"""The direct turns' cooperative budget: a caller of an idle actor yields to the event
loop exactly once every ``yield_every`` calls, so a task calling the pool in a loop
still lets others run and still sees its deadline."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kvpool.actors import YIELD_EVERY, PoolClient, open_actor, open_pool
from kvpool.errors import InvalidArgumentError

HANG_GUARD = 30  # seconds; a guard against hangs, never a timing assertion


async def _ticks_during(pool: PoolClient, calls: int) -> int:
    """How many times a second task ran while this one made ``calls`` direct turns."""
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        while ticks == 0:  # the ticker is running, the actor asleep
            await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        before = ticks
        for _ in range(calls):
            await pool.prefix_hit(1)
        ran = ticks - before
        done = True
    return ran


@pytest.mark.anyio
@pytest.mark.parametrize("yield_every", [1, 4, YIELD_EVERY])
async def test_a_caller_yields_once_every_yield_every_direct_turns(yield_every: int) -> None:
    # Any yield_every consecutive direct turns contain exactly one that spends the last
    # unit of the budget, whatever the budget was before them.
    async with open_pool(8, yield_every=yield_every) as pool:
        assert pool._actor.yield_every == yield_every
        rounds = 6
        ran = await _ticks_during(pool, rounds * yield_every)
        # Each yield lets the ticker run once; the last one may fall either side of
        # the count (trio runs a batch of ready tasks in random order).
        assert rounds - 1 <= ran <= rounds + 1, (ran, rounds)


@pytest.mark.anyio
async def test_the_default_budget_is_yield_every() -> None:
    async with open_pool(8) as pool:
        assert pool._actor.yield_every == YIELD_EVERY
        ran = await _ticks_during(pool, 3 * YIELD_EVERY)
        assert 2 <= ran <= 4


@pytest.mark.anyio
async def test_a_loop_of_calls_still_sees_its_deadline() -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_pool(8) as pool:
            calls = 0
            with anyio.move_on_after(0.01) as scope:
                # Without yields the deadline could never land: bounded, not a hang.
                while calls < 10_000_000:
                    await pool.prefix_hit(1)
                    calls += 1
            assert scope.cancelled_caught, "the deadline never landed"
            assert 0 < calls < 10_000_000
            stats = await pool.stats()
            assert (stats.num_active, stats.num_active_refs) == (0, 0)


@pytest.mark.anyio
async def test_a_looping_caller_shares_the_loop_with_other_callers() -> None:
    # Two tasks each make many calls; under the budget they interleave in chunks rather
    # than one finishing before the other starts.
    order: list[str] = []
    async with open_pool(8) as pool:

        async def caller(name: str) -> None:
            for _ in range(8 * YIELD_EVERY):
                await pool.prefix_hit(1)
                order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, "a")
            tg.start_soon(caller, "b")
    switches = sum(1 for x, y in pairwise(order) if x != y)
    assert switches >= 8, switches


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
async def test_a_bad_yield_every_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="yield_every"):
        async with open_pool(8, yield_every=bad):
            pass  # pragma: no cover
    with pytest.raises(InvalidArgumentError, match="yield_every"):
        async with open_actor({}, yield_every=bad):
            pass  # pragma: no cover
