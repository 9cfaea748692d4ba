"""The actor's cancellation contract, FIFO waiters, shutdown and crash, on every backend."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import pytest
import uvloop

from kvpool.actors import POOL_ACTOR, Actor, Handler, PoolClient, PoolState, open_pool
from kvpool.actors.slots import current_slots
from kvpool.errors import (
    InvariantViolationError,
    PoolClosedError,
    PoolCrashedError,
    ReservationExhaustedError,
)
from kvpool.messages import Admission, Admit, Free, GetStats, Release
from kvpool.pool import BlockPool

HANG_GUARD = 30  # seconds; a guard against hangs, never a timing assertion


async def _counts(pool: PoolClient) -> tuple[int, int, int]:
    stats = await pool.stats()
    return stats.num_active, stats.num_inactive, stats.num_active_refs


async def _until(condition: Callable[[], Awaitable[bool]]) -> None:
    while not await condition():
        await anyio.lowlevel.checkpoint()


async def _waiters(pool: PoolClient, count: int) -> None:
    async def enough() -> bool:
        return (await pool.stats()).waiters >= count

    await _until(enough)


# -------------------------------------------- all or nothing, at every point


async def _seeded(pool: PoolClient) -> list[int]:
    """Two resident inactive hashes (1, 2) to build prefixes from."""
    admission = await pool.admit([1, 2])
    assert admission is not None
    await pool.cache_many(list(zip(admission.blocks, [1, 2], strict=True)))
    await pool.free(admission.blocks)
    return [1, 2]


async def _sweep(
    pool: PoolClient,
    call: Callable[[], Awaitable[Any]],
    give_back: Callable[[Any], Awaitable[None]],
) -> None:
    """Cancel ``call``'s caller after 0, 1, 2, ... checkpoints; state must come back."""
    before = await _counts(pool)
    for delay in range(10):
        got: list[Any] = []
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def caller(scope: anyio.CancelScope = scope, got: list[Any] = got) -> None:
                with scope:
                    got.append(await call())

            tg.start_soon(caller)
            for _ in range(delay):
                await anyio.lowlevel.checkpoint()
            scope.cancel()
        for result in got:  # the caller read it: it is the caller's to give back
            await give_back(result)
        assert await _counts(pool) == before, f"cancelled after {delay} checkpoints"
    await pool.check_invariants()


@pytest.mark.anyio
async def test_reserve_is_all_or_nothing_under_cancellation() -> None:
    async with open_pool(8) as pool:
        prefix = await _seeded(pool)

        async def give_back(outcome: Any) -> None:
            if outcome is not None:
                await pool.cancel(outcome.reservation)

        await _sweep(pool, lambda: pool.reserve(prefix, 3), give_back)


@pytest.mark.anyio
async def test_admit_is_all_or_nothing_under_cancellation() -> None:
    async with open_pool(8) as pool:
        await _seeded(pool)

        async def give_back(admission: Admission | None) -> None:
            if admission is not None:
                await pool.free(admission.blocks)

        await _sweep(pool, lambda: pool.admit([1, 2, 3], 2), give_back)


async def _drain_reservation(pool: PoolClient, reservation: Any) -> tuple[int, int]:
    """Spend everything the actor says the reservation holds; give it all back."""
    prefix = await pool.activate_prefix(reservation)
    fresh = []
    while True:
        try:
            fresh.append(await pool.allocate_private(reservation))
        except ReservationExhaustedError:
            break
    await pool.free([*prefix, *fresh])
    await pool.cancel(reservation)
    return len(prefix), len(fresh)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["activate_prefix", "allocate_private", "allocate_cached"])
async def test_reservation_spending_calls_are_all_or_nothing_under_cancellation(
    kind: str,
) -> None:
    async with open_pool(8) as pool:
        prefix = await _seeded(pool)
        before = await _counts(pool)
        outcomes = set()
        cached_by_caller: set[int] = set()
        for delay in range(10):
            outcome = await pool.reserve(prefix, 2)
            assert outcome is not None
            reservation = outcome.reservation
            calls = {
                "activate_prefix": lambda r=reservation: pool.activate_prefix(r),
                "allocate_private": lambda r=reservation: pool.allocate_private(r),
                "allocate_cached": lambda r=reservation: pool.allocate_cached(r, 77),
            }
            got: list[Any] = []
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def caller(
                    scope: anyio.CancelScope = scope, call: Any = calls[kind], got: list[Any] = got
                ) -> None:
                    with scope:
                        got.append(await call())

                tg.start_soon(caller)
                for _ in range(delay):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
            if got:  # the caller read the result: it owns it
                result = got[0]
                owned = (
                    result
                    if isinstance(result, list)
                    else [result[0]]
                    if isinstance(result, tuple)
                    else [result]
                )
                await pool.free(owned)
            expected = (2, 2)
            if got:
                expected = (0, 2) if kind == "activate_prefix" else (2, 1)
            assert (reservation.prefix_len, reservation.fresh) == expected
            assert await _drain_reservation(pool, reservation) == expected
            outcomes.add(bool(got))
            # A copy allocate_cached made and the caller read stays cached (idle); an
            # undone one left the pool: compare what is held.
            active, _inactive, refs = await _counts(pool)
            assert (active, refs) == (before[0], before[2]), f"cancelled after {delay}"
            if kind == "allocate_cached" and not got and 77 not in cached_by_caller:
                assert await pool.prefix_hit(77) is None, f"cancelled after {delay}"
            if got and kind == "allocate_cached":
                cached_by_caller.add(77)
        # Every call passes a checkpoint before and after its turn.
        assert outcomes == {False, True}, "the sweep should both interrupt and complete"
        await pool.check_invariants()


# ------------------------------------- asyncio: a reply delivered but never read


ASYNCIO_LOOPS = [pytest.param(asyncio.run, id="asyncio"), pytest.param(uvloop.run, id="uvloop")]


@pytest.mark.parametrize("run", ASYNCIO_LOOPS)
@pytest.mark.parametrize(
    "kind", ["reserve", "admit", "activate_prefix", "allocate_private", "allocate_cached"]
)
def test_an_unread_reply_is_undone_by_the_actor(
    kind: str, run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plain asyncio task.cancel() lands even after the reply is in the future, which
    # is exactly the "replied but not read" window; a spy proves the sweep hit it.
    undone: list[str] = []
    for name in ["undo_reserve", "undo_admit", "undo_activate_prefix", "undo_allocate"]:
        original = getattr(PoolState, name)

        def spy(self: PoolState, message: Any, reply: Any, original: Any = original) -> None:
            undone.append(type(message).__name__)
            original(self, message, reply)

        monkeypatch.setattr(PoolState, name, spy)

    async def scenario() -> None:
        async with open_pool(8) as pool:
            prefix = await _seeded(pool)
            before = await _counts(pool)
            for delay in range(6):
                outcome = await pool.reserve(prefix, 2)
                assert outcome is not None
                reservation = outcome.reservation
                calls = {
                    "reserve": lambda p=prefix: pool.reserve(p, 2),
                    "admit": lambda: pool.admit([1, 2, 3]),
                    "activate_prefix": lambda r=reservation: pool.activate_prefix(r),
                    "allocate_private": lambda r=reservation: pool.allocate_private(r),
                    "allocate_cached": lambda r=reservation: pool.allocate_cached(r, 77),
                }
                task = asyncio.get_running_loop().create_task(calls[kind]())
                for _ in range(delay):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    result = await task
                except asyncio.CancelledError:
                    pass
                else:  # completed before the cancel: the test owns the result
                    if kind == "reserve":
                        await pool.cancel(result.reservation)
                    elif kind == "admit":
                        await pool.free(result.blocks)
                    elif kind == "allocate_cached":
                        await pool.free([result[0]])
                        await _drain_reservation(pool, reservation)
                        # The copy the caller read stays cached, idle: evict it again.
                        flush = await pool.admit([], 8)
                        assert flush is not None
                        await pool.free(flush.blocks)
                        prefix = await _seeded(pool)
                        before = await _counts(pool)
                        continue
                    else:
                        await pool.free(result if isinstance(result, list) else [result])
                await _drain_reservation(pool, reservation)
                # An undone allocate_cached leaves nothing behind: not even its hash.
                assert await _counts(pool) == before, f"cancelled after {delay} loop turns"
                assert await pool.prefix_hit(77) is None
            await pool.check_invariants()

    run(scenario())
    assert undone, "no cancellation landed between the reply and its reading"


# ------------------------------------------ giving back takes effect once posted


@pytest.mark.anyio
async def test_release_cancel_and_free_take_effect_even_if_the_caller_is_cancelled() -> None:
    async with open_pool(8) as pool:
        admission = await pool.admit([], 3)
        outcome = await pool.reserve([], 2)
        assert admission is not None
        assert outcome is not None
        blocks = admission.blocks
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pool.release(blocks[0])
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pool.free(blocks[1:])
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pool.cancel(outcome.reservation)
        assert await _counts(pool) == (0, 0, 0)
        assert outcome.reservation.closed


@pytest.mark.anyio
async def test_a_call_made_in_a_cancelled_scope_raises_and_takes_no_effect() -> None:
    async with open_pool(8) as pool:
        returned: dict[str, Any] = {}
        with anyio.CancelScope() as scope:
            scope.cancel()
            returned["reserve"] = await pool.reserve([], 3)
        assert scope.cancelled_caught
        with anyio.CancelScope() as scope:
            scope.cancel()
            returned["admit"] = await pool.admit([5, 6])
        assert scope.cancelled_caught
        stats = await pool.stats()
        # An ownership-giving call in a cancelled scope never reaches the actor.
        assert returned == {}
        assert (stats.reserves, stats.reserve_failures) == (0, 0)
        assert await _counts(pool) == (0, 0, 0)


# ---------------------------------------------------------------- FIFO waiters


@pytest.mark.anyio
async def test_waiters_are_granted_in_fifo_order() -> None:
    async with open_pool(4) as pool:
        hold = await pool.admit([], 4)
        assert hold is not None
        granted: list[str] = []
        admissions: dict[str, Admission] = {}

        async def wait_for(name: str, blocks: int) -> None:
            admission = await pool.admit([], blocks, wait=True)
            assert admission is not None
            granted.append(name)
            admissions[name] = admission

        async with anyio.create_task_group() as tg:
            for count, (name, blocks) in enumerate([("a", 2), ("b", 1), ("c", 2), ("d", 1)]):
                tg.start_soon(wait_for, name, blocks)
                await _waiters(pool, count + 1)
            await pool.release(hold.blocks[0])  # 1 free: the head (a, 2) still waits
            assert granted == []
            assert (await pool.stats()).waiters == 4
            await pool.free(hold.blocks[1:])  # 4 free: a and b fit, c (2) does not
            while len(granted) < 2:
                await anyio.lowlevel.checkpoint()
            assert sorted(granted) == ["a", "b"]
            assert (await pool.stats()).waiters == 2
            await pool.free(admissions["a"].blocks)  # c then d
        # Tasks granted in one turn may wake in any order (trio shuffles), so read the
        # grant order from the block ids, which a pool hands out in increasing order.
        by_grant = sorted(admissions, key=lambda name: admissions[name].blocks[0])
        assert by_grant == ["a", "b", "c", "d"]
        for admission in admissions.values():
            if admission is not admissions["a"]:
                await pool.free(admission.blocks)
        assert await _counts(pool) == (0, 0, 0)


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_the_queue_without_a_trace() -> None:
    async with open_pool(4) as pool:
        hold = await pool.admit([], 3)
        assert hold is not None
        got: list[Admission | None] = []
        async with anyio.create_task_group() as tg:
            head = anyio.CancelScope()

            async def big() -> None:
                with head:
                    got.append(await pool.admit([9, 10], wait=True))  # needs 2, 1 is free

            async def small() -> None:
                got.append(await pool.admit([11], wait=True))  # fits, but queued behind

            tg.start_soon(big)
            await _waiters(pool, 1)
            tg.start_soon(small)
            await _waiters(pool, 2)
            assert got == []
            head.cancel()  # the head leaves: the small one is granted without a release
        assert len(got) == 1
        assert got[0] is not None
        assert len(got[0].blocks) == 1
        stats = await pool.stats()
        assert (stats.waiters, stats.num_active, stats.reserves) == (0, 4, 2)
        await pool.free([*hold.blocks, *got[0].blocks])
        assert await _counts(pool) == (0, 0, 0)


@pytest.mark.anyio
async def test_waiting_for_more_than_the_whole_pool_fails_at_once() -> None:
    from kvpool.errors import CapacityError

    async with open_pool(4) as pool:
        with anyio.fail_after(HANG_GUARD), pytest.raises(CapacityError):
            await pool.admit([1, 2, 3], 2, wait=True)
        assert (await pool.stats()).waiters == 0


# -------------------------------------------------------------------- shutdown


def _num_queued(actor: Actor) -> int:
    return actor._receive.statistics().current_buffer_used


@pytest.mark.anyio
async def test_close_handles_everything_already_queued_then_fails_waiters() -> None:
    state = PoolState(BlockPool(4))
    actor = Actor(state.table(), current_slots(), POOL_ACTOR)  # not started: calls stay queued
    state.count_waiters = lambda: actor.num_waiters
    hold = state.admit(Admit([], 4)).admission
    assert hold is not None
    results: dict[str, Any] = {}

    async def record(name: str, message: Any) -> None:
        try:
            results[name] = await actor.call(message)
        except PoolClosedError as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(record, "fits after the free", Admit([], 3, True))
        while _num_queued(actor) < 1:
            await anyio.lowlevel.checkpoint()
        tg.start_soon(record, "never fits", Admit([], 4, True))
        while _num_queued(actor) < 2:
            await anyio.lowlevel.checkpoint()
        tg.start_soon(record, "free", Free(hold.blocks))
        while _num_queued(actor) < 3:
            await anyio.lowlevel.checkpoint()
        tg.start_soon(record, "stats", GetStats())
        while _num_queued(actor) < 4:
            await anyio.lowlevel.checkpoint()
        actor.close()
        with pytest.raises(PoolClosedError):  # refused at once, never queued
            await actor.call(GetStats())
        tg.start_soon(actor.run)  # the actor handles what was queued before the close
    assert results["fits after the free"].admission is not None
    assert isinstance(results["never fits"], PoolClosedError)
    assert results["stats"].stats.num_active == 3
    assert type(results["free"]).__name__ == "DoneReply"
    with pytest.raises(PoolClosedError):
        await actor.call(GetStats())


@pytest.mark.anyio
async def test_leaving_open_pool_drains_queued_work_and_closes_later_calls() -> None:
    states: list[PoolState] = []

    def capture(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return {}

    results: dict[str, Any] = {}

    async def record(name: str, call: Awaitable[Any]) -> None:
        try:
            results[name] = await call
        except PoolClosedError as exc:
            results[name] = exc

    async with anyio.create_task_group() as outside:
        async with open_pool(4, extensions=[capture]) as pool:
            hold = await pool.admit([], 4)
            assert hold is not None
            outside.start_soon(record, "small", pool.admit([], 3, wait=True))
            await _waiters(pool, 1)
            outside.start_soon(record, "big", pool.admit([], 4, wait=True))
            await _waiters(pool, 2)
            with anyio.CancelScope() as scope:  # posted, never awaited: still happens
                scope.cancel()
                await pool.free(hold.blocks)
        with pytest.raises(PoolClosedError):
            await pool.stats()
    assert isinstance(results["small"], Admission)
    assert isinstance(results["big"], PoolClosedError)
    assert states[0].pool.num_active() == 3


# ----------------------------------------------------------------------- crash


class Explode(msgspec.Struct, frozen=True, tag=True):
    """A test-only message whose handler is a bug."""

    error: str


def _bomb(state: PoolState) -> dict[type, Handler[Any, Any]]:
    def explode(message: Explode) -> None:
        if message.error == "invariant":
            raise InvariantViolationError("deliberately broken")
        raise RuntimeError("deliberately broken")

    return {Explode: Handler(explode)}


@pytest.mark.anyio
@pytest.mark.parametrize("error", ["invariant", "runtime"])
async def test_a_crash_fails_every_pending_and_later_call_everywhere(error: str) -> None:
    outcomes: dict[str, BaseException | None] = {}

    async def record(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            await call()
            outcomes[name] = None
        except PoolCrashedError as exc:
            outcomes[name] = exc

    clients: list[PoolClient] = []

    async def crash_it(outside: anyio.abc.TaskGroup) -> None:
        async with open_pool(4, extensions=[_bomb]) as pool:
            clients.append(pool)
            hold = await pool.admit([], 4)
            assert hold is not None
            outside.start_soon(record, "outside waiter", lambda: pool.admit([], 2, wait=True))
            await _waiters(pool, 1)
            async with anyio.create_task_group() as inside:
                inside.start_soon(record, "inside waiter", lambda: pool.admit([], 1, wait=True))
                await _waiters(pool, 2)
                inside.start_soon(record, "bomb", lambda: pool.call(Explode(error)))
                await anyio.sleep_forever()  # the crash cancels the body

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as outside:
            with pytest.raises(PoolCrashedError) as crashed:
                await crash_it(outside)
            assert isinstance(crashed.value.__cause__, InvariantViolationError | RuntimeError)
            with pytest.raises(PoolCrashedError) as later:
                await clients[0].stats()
            assert later.value.__cause__ is crashed.value.__cause__
    assert set(outcomes) == {"outside waiter", "inside waiter", "bomb"}
    for name, exc in outcomes.items():
        assert isinstance(exc, PoolCrashedError), name
        assert exc.__cause__ is crashed.value.__cause__


@pytest.mark.anyio
async def test_a_crash_reaches_a_caller_outside_the_pool_block_promptly() -> None:
    errors: list[BaseException] = []

    async def record(call: Awaitable[Any]) -> None:
        try:
            await call
        except PoolCrashedError as exc:
            errors.append(exc)

    clients: list[PoolClient] = []

    async def crash_it(outside: anyio.abc.TaskGroup) -> None:
        async with open_pool(2, extensions=[_bomb]) as pool:
            clients.append(pool)
            outside.start_soon(record, pool.call(Explode("runtime")))
            await anyio.sleep_forever()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as outside:
            with pytest.raises(PoolCrashedError):
                await crash_it(outside)
            with pytest.raises(PoolCrashedError):
                await clients[0].release(123)  # type: ignore[arg-type]
    assert len(errors) == 1
    assert isinstance(errors[0].__cause__, RuntimeError)


# ----------------------------------------------------- exceptions out of open_pool


@pytest.mark.anyio
async def test_an_exception_from_the_body_propagates_unwrapped() -> None:
    async def body() -> None:
        async with open_pool(2) as pool:
            await pool.stats()
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        await body()


@pytest.mark.anyio
async def test_an_outer_cancellation_still_closes_the_pool() -> None:
    clients: list[PoolClient] = []
    with anyio.move_on_after(HANG_GUARD) as outer:
        async with open_pool(2) as pool:
            clients.append(pool)
            admission = await pool.admit([], 1)
            assert admission is not None
            async with pool.lease([], 1):
                outer.cancel()
                await anyio.sleep_forever()
    assert outer.cancelled_caught
    with pytest.raises(PoolClosedError):
        await clients[0].stats()


@pytest.mark.anyio
async def test_an_unknown_message_kind_is_refused() -> None:
    from kvpool.errors import InvalidArgumentError

    async with open_pool(2) as pool:
        with pytest.raises(InvalidArgumentError):
            await pool.call(Explode("runtime"))
        with pytest.raises(InvalidArgumentError):
            await pool.call(Release)  # the class, not a message
        assert await _counts(pool) == (0, 0, 0)
