"""The actor's runtime guarantees: one task runs every handler, the asyncio fast cancel
check agrees with anyio, a client refuses other threads, an unread reply is undone
exactly (also during close), and a crash fails everything pending."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec
import pytest
import sniffio
import uvloop

from kvpool.actors import POOL_ACTOR, Actor, Handler, PoolClient, PoolState, open_actor, open_pool
from kvpool.actors import actor as actor_module
from kvpool.actors import slots as slots_module
from kvpool.actors.slots import current_slots
from kvpool.errors import (
    PoolClosedError,
    PoolCrashedError,
    PoolError,
    ReservationExhaustedError,
    WrongLoopError,
)
from kvpool.manager import KvManager, open_manager
from kvpool.messages import Admit, GetStats, QueryPrefix
from kvpool.pool import BlockPool

HANG_GUARD = 30  # seconds; a guard against hangs, never a timing assertion

ASYNCIO_ONLY = pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop"),
    ],
)
"""For what only asyncio has: a plain task.cancel() landing on a reply not yet read."""


async def _counts(pool: PoolClient) -> tuple[int, int, int]:
    stats = await pool.stats()
    return stats.num_active, stats.num_inactive, stats.num_active_refs


def _capture(states: list[PoolState]) -> Callable[[PoolState], dict[type, Handler[Any, Any]]]:
    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return {}

    return extension


async def _seed_inactive(pool: PoolClient, hashes: list[int]) -> None:
    admission = await pool.admit(hashes)
    assert admission is not None
    await pool.cache_many(list(zip(admission.blocks, hashes, strict=True)))
    await pool.free(admission.blocks)


# ------------------------------------------------ every handler runs in the actor's task


def _record_tasks(actor: Actor, seen: list[tuple[str, int]]) -> None:
    """Wrap every handler, undo and waits of ``actor`` to record the running task."""

    def wrap(function: Callable[..., Any] | None, what: str) -> Callable[..., Any] | None:
        if function is None:
            return None

        def recorded(*args: Any) -> Any:
            seen.append((what, anyio.get_current_task().id))
            return function(*args)

        return recorded

    for kind, handler in list(actor._handlers.items()):
        name = kind.__name__
        actor._handlers[kind] = Handler(
            wrap(handler.handle, f"{name}.handle"),  # type: ignore[arg-type]
            wrap(handler.undo, f"{name}.undo"),
            handler.gives_back,
            wrap(handler.waits, f"{name}.waits"),
        )


async def _lifecycle(pool: PoolClient, rng: random.Random) -> None:
    """Admit (maybe waiting), cache, free or spend a reservation; cancelled at random."""
    owned: list[int] = []
    reservation: Any = None
    with anyio.move_on_after(rng.choice([math.inf, 0, 1e-4, 1e-3])):
        if rng.random() < 0.6:
            chain = [rng.randrange(4) * 100 + k for k in range(rng.randint(1, 6))]
            admission = await pool.admit(chain, rng.randint(0, 2), wait=rng.random() < 0.6)
            if admission is not None:
                owned = list(admission.blocks)
                fresh = owned[admission.cached : len(chain)]
                await pool.cache_many(list(zip(fresh, chain[admission.cached :], strict=False)))
                await anyio.sleep(rng.choice([0, 1e-4]))
        else:
            outcome = await pool.reserve([], rng.randint(0, 3))
            if outcome is not None:
                reservation = outcome.reservation
                for _ in range(reservation.fresh):
                    if rng.random() < 0.5:
                        owned.append(await pool.allocate_private(reservation))
                    else:
                        block, _ = await pool.allocate_cached(reservation, rng.randrange(50))
                        owned.append(block)
    if reservation is not None and not reservation.closed:
        await pool.cancel(reservation)  # give-backs need no shield
    if owned:
        await pool.free(owned)


@pytest.mark.anyio
async def test_every_handler_ran_in_the_actors_task() -> None:
    seen: list[tuple[str, int]] = []
    closed: list[BaseException] = []
    actors: list[Actor] = []
    rng = random.Random(9)
    asyncio_tasks: list[Any] = []

    async def late_waiter(pool: PoolClient) -> None:
        try:
            await pool.admit([], 16, wait=True)
        except PoolClosedError as exc:
            closed.append(exc)

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as outside, open_pool(16) as pool:
            actor = pool._call.__self__  # type: ignore[attr-defined]
            actors.append(actor)
            _record_tasks(actor, seen)
            async with anyio.create_task_group() as tg:
                for _ in range(300):
                    tg.start_soon(_lifecycle, pool, random.Random(rng.random()))
            if sniffio.current_async_library() == "asyncio":
                # Plain task cancels land on replies not yet read: the undos run.
                for delay in range(40):
                    task = asyncio.ensure_future(pool.admit([], 1 + delay % 3))
                    for _ in range(delay % 5):
                        await asyncio.sleep(0)
                    task.cancel()
                    asyncio_tasks.append(task)
                await asyncio.gather(*asyncio_tasks, return_exceptions=True)
                for task in asyncio_tasks:
                    if not task.cancelled() and task.result() is not None:
                        await pool.free(task.result().blocks)
            stats = await pool.stats()
            assert (stats.num_active, stats.num_active_refs) == (0, 0)
            await pool.check_invariants()
            await _every_call_once(pool)
            hold = await pool.admit([], 16, wait=True)
            assert hold is not None
            async with anyio.create_task_group() as tg:  # one waiter granted
                tg.start_soon(lambda: pool.admit([], 1, wait=True))
                while (await pool.stats()).waiters == 0:
                    await anyio.lowlevel.checkpoint()
                await pool.free(hold.blocks[-1:])
            outside.start_soon(late_waiter, pool)  # one still waiting at the close
            while (await pool.stats()).waiters == 0:
                await anyio.lowlevel.checkpoint()
    (actor,) = actors
    assert actor.task_id is not None
    assert len(closed) == 1  # the waiter left at the close failed
    kinds = {what for what, _ in seen}
    assert {"Admit.handle", "Admit.waits", "Free.handle", "Reserve.handle"} <= kinds
    assert {"AllocateCached.handle", "AllocatePrivate.handle", "Cancel.handle"} <= kinds
    assert {"ActivatePrefix.handle", "CachePrivate.handle", "Release.handle"} <= kinds
    assert {"CacheMany.handle", "QueryPrefix.handle", "GetStats.handle"} <= kinds
    if sniffio.current_async_library() == "asyncio":
        assert "Admit.undo" in kinds, "no undo ran"
    assert {task_id for _, task_id in seen} == {actor.task_id}


async def _every_call_once(pool: PoolClient) -> None:
    admission = await pool.admit([900], 1)
    assert admission is not None
    await pool.cache_private(admission.blocks[0], 900)
    await pool.release(admission.blocks[1])
    await pool.free(admission.blocks[:1])
    outcome = await pool.reserve([900], 3)
    assert outcome is not None
    reservation = outcome.reservation
    held = await pool.activate_prefix(reservation)
    held.append(await pool.allocate_private(reservation))
    held.append((await pool.allocate_cached(reservation, 901))[0])
    await pool.cancel(reservation)
    assert await pool.prefix_hit(901) is not None
    await pool.free(held)


class Ping(msgspec.Struct, frozen=True, tag=True):
    pass


@pytest.mark.anyio
async def test_open_actors_task_id_is_the_task_that_runs_its_handlers() -> None:
    ran: list[int] = []

    def ping(message: Ping) -> int:
        ran.append(anyio.get_current_task().id)
        return len(ran)

    async with open_actor({Ping: Handler(ping)}) as actor:
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(actor.call, Ping())
        assert await actor.call(Ping()) == 21
        assert actor.task_id not in {None, anyio.get_current_task().id}
    assert set(ran) == {actor.task_id}


@pytest.mark.anyio
async def test_a_managers_handlers_run_in_its_actors_task() -> None:
    seen: list[tuple[str, int]] = []
    with anyio.fail_after(HANG_GUARD):
        async with open_manager(8, 4) as kv:
            actor = kv._call.__self__  # type: ignore[attr-defined]
            _record_tasks(actor, seen)
            await _drive_a_manager(kv, actor)
    assert len({what for what, _ in seen}) >= 8
    assert "AllocateSlots.waits" in {what for what, _ in seen}
    assert {task_id for _, task_id in seen} == {actor.task_id}


async def _drive_a_manager(kv: Any, actor: Actor) -> None:
    await kv.add_request("a", list(range(32)))
    await kv.add_request("b", list(range(100, 108)))
    await kv.add_request("c", list(range(200, 204)))
    assert await kv.allocate("a", 32) is not None  # the whole pool
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: kv.allocate("b", 8, wait=True))
        while actor.num_waiters == 0:
            await anyio.lowlevel.checkpoint()
        tg.start_soon(lambda: kv.allocate("c", 4, wait=True))  # asks waits()
        while actor.num_waiters < 2:
            await anyio.lowlevel.checkpoint()
        await kv.mark_computed("a", 32)
        await kv.preempt("a")
    await kv.take_events()
    await kv.free("b")
    await kv.free("c")
    await kv.free("a")
    await kv.check_invariants()


# ------------------------------------------------- the asyncio fast cancel check


def test_the_fast_trio_cancel_check_agrees_with_trio() -> None:
    # The trio slot opener reads the task's private ``_cancel_status`` (what trio's own
    # checkpoint_if_cancelled reads): it must agree with trio's public deadline answer.
    import trio

    async def scenario() -> None:
        status = getattr(trio.lowlevel.current_task(), "_cancel_status", None)
        assert status is not None, "the fast check is off here"
        open_slot = slots_module.trio_slots().open

        def agree() -> bool:
            expected = trio.current_effective_deadline() == -math.inf
            assert (open_slot(True) is None) is expected
            return expected

        assert agree() is False
        with trio.CancelScope() as outer:
            assert agree() is False
            outer.cancel()
            assert agree() is True
            with trio.CancelScope(shield=True):
                assert agree() is False
                with trio.CancelScope() as nested:
                    nested.cancel()
                    assert agree() is True
                assert agree() is False
            assert agree() is True
        assert agree() is False
        with trio.CancelScope(deadline=-math.inf):  # a deadline already past
            assert agree() is True

    trio.run(scenario)


@ASYNCIO_ONLY
@pytest.mark.anyio
async def test_the_fast_cancel_check_agrees_with_anyio() -> None:
    # The asyncio slot opener reads anyio's scope state directly (and caches each
    # task's state): opening a slot at a cancel point fails (None) exactly when anyio
    # says the calling task's effective deadline is -inf.
    assert slots_module._anyio_task_states() is not None, "the fast check is off here"
    open_slot = slots_module.asyncio_slots().open

    def check() -> bool:
        return open_slot(True) is None

    def agree() -> bool:
        expected = anyio.current_effective_deadline() == -math.inf
        assert check() is expected
        assert open_slot(False) is not None  # a give-back opens its slot regardless
        return expected

    assert agree() is False  # no scope of our own
    with anyio.CancelScope() as outer:
        assert agree() is False  # a scope not cancelled
        outer.cancel()
        assert agree() is True  # a cancelled scope
        with anyio.CancelScope(shield=True):
            assert agree() is False  # shielded inside a cancelled scope
            with anyio.CancelScope() as nested:
                assert agree() is False
                nested.cancel()
                assert agree() is True  # cancelled inside a shield
            assert agree() is False
        assert agree() is True
    assert agree() is False  # after leaving a cancelled scope
    with anyio.move_on_after(-1):
        assert agree() is True  # a deadline already past

    results: list[bool] = []

    async def child() -> None:
        results.append(agree())
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(child)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
        assert agree() is True  # the host task, inside the cancelled task group
    assert results == [False]

    async def child_of_a_cancelled_group() -> None:
        results.append(agree())

    async with anyio.create_task_group() as tg:
        tg.cancel_scope.cancel()
        tg.start_soon(child_of_a_cancelled_group)
    # Started in a cancelled group, the child sees its cancellation (or never runs).
    assert results in ([False], [False, True])

    async def plain() -> bool:  # a task anyio never saw: no scope state at all
        return check() is (anyio.current_effective_deadline() == -math.inf)

    assert await asyncio.ensure_future(plain())


@pytest.mark.anyio
async def test_the_mailbox_peek_agrees_with_anyio() -> None:
    # The actor tells an empty mailbox from anyio's buffer instead of a WouldBlock: the
    # peek must find the buffer here, and "open with an empty buffer" must be exactly
    # when receive_nowait raises WouldBlock.
    send, receive = anyio.create_memory_object_stream[int](math.inf)
    buffer = actor_module._buffer_of(receive)
    assert buffer is not None, "the peek is off here"

    def peeks_empty() -> bool:
        return not buffer and not receive._closed

    def would_block() -> bool:
        try:
            item = receive.receive_nowait()
        except anyio.WouldBlock:
            return True
        send.send_nowait(item)  # put back (the order of one item does not matter)
        return False

    assert peeks_empty()
    assert would_block()
    for count in (1, 3):
        for item in range(count):
            send.send_nowait(item)
        assert not peeks_empty()
        assert not would_block()
        assert sorted(receive.receive_nowait() for _ in range(count)) == list(range(count))
        assert peeks_empty()
        assert would_block()
    send.send_nowait(7)
    receive.close()  # closed with an item still buffered: the peek defers to anyio
    assert not peeks_empty()
    with pytest.raises(anyio.ClosedResourceError):
        receive.receive_nowait()
    send.close()


@pytest.mark.anyio
async def test_a_shielded_call_inside_a_cancelled_scope_runs() -> None:
    async with open_pool(4) as pool:
        with anyio.CancelScope() as scope:
            scope.cancel()
            with anyio.CancelScope(shield=True):
                admission = await pool.admit([], 2)  # shielded: not cancelled
            assert admission is not None
            await pool.free(admission.blocks)
            with anyio.CancelScope(shield=True):
                with anyio.CancelScope() as nested:
                    nested.cancel()
                    await pool.admit([], 2)  # cancelled inside the shield
                assert nested.cancelled_caught
                assert (await pool.stats()).num_active == 0
            await pool.admit([], 2)
            pytest.fail("the cancellation was not raised")  # pragma: no cover
        assert scope.cancelled_caught
        assert (await pool.stats()).reserves == 1


# --------------------------------------------------------------- other threads


def _in_a_plain_thread(function: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=function, name="not-the-pool-loop")
    thread.start()
    return thread


@pytest.mark.anyio
@pytest.mark.parametrize("thread_backend", ["asyncio", "trio"])
async def test_a_client_used_from_another_thread_raises_wrong_loop(thread_backend: str) -> None:
    async with open_pool(8) as pool:
        held = await pool.admit([1, 2], 1)
        assert held is not None
        before = await _counts(pool)
        errors: list[BaseException] = []

        async def use() -> None:
            for call in [
                lambda: pool.admit([], 2),
                lambda: pool.free(held.blocks),  # a give-back is refused as well
                pool.stats,
                lambda: pool.call(GetStats()),
            ]:
                try:
                    await call()
                except BaseException as exc:
                    errors.append(exc)

        thread = _in_a_plain_thread(lambda: anyio.run(use, backend=thread_backend))
        with anyio.fail_after(HANG_GUARD):
            await anyio.to_thread.run_sync(thread.join)
        assert len(errors) == 4
        for error in errors:
            assert isinstance(error, WrongLoopError), error
            assert isinstance(error, PoolError)
            assert "anyio.from_thread" in str(error)
        assert await _counts(pool) == before
        await pool.check_invariants()
        await pool.free(held.blocks)


@pytest.mark.anyio
async def test_a_worker_thread_reaches_the_pool_through_anyio_from_thread() -> None:
    async with open_pool(8) as pool:

        def worker() -> tuple[int, tuple[int, int, int]]:
            admission = anyio.from_thread.run(pool.admit, [1, 2], 1)
            assert admission is not None
            during = anyio.from_thread.run(_counts, pool)
            anyio.from_thread.run(pool.free, admission.blocks)
            return len(admission.blocks), during

        with anyio.fail_after(HANG_GUARD):
            blocks, during = await anyio.to_thread.run_sync(worker)
        assert blocks == 3
        assert during == (3, 0, 3)
        assert await _counts(pool) == (0, 0, 0)


# ------------------------------------------------ an unread reply, undone exactly


@ASYNCIO_ONLY
@pytest.mark.anyio
@pytest.mark.parametrize("resident", [False, True], ids=["new-hash", "duplicate"])
async def test_an_unread_allocate_cached_is_undone_exactly(resident: bool) -> None:
    states: list[PoolState] = []
    async with open_pool(8, extensions=[_capture(states)]) as pool:
        (state,) = states
        if resident:
            await _seed_inactive(pool, [77])  # the allocation below makes a duplicate
        outcome = await pool.reserve([], 2)
        assert outcome is not None
        reservation = outcome.reservation
        before = (await _counts(pool), await pool.prefix_hit(77))
        refs = state.pool.num_active_refs()
        task = asyncio.ensure_future(pool.allocate_cached(reservation, 77))
        while state.pool.num_active_refs() == refs:  # the actor has replied
            await asyncio.sleep(0)
        assert not task.done(), "the caller read its reply before it could be cancelled"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Queued behind the undo: the copy is gone, the hash as it was, the unit back.
        assert (await _counts(pool), await pool.prefix_hit(77)) == before
        held = state._held[reservation.id]
        assert [part.fresh for part in held.parts] == [2]
        assert reservation.fresh == 2  # the client's mirror never counted the call
        spent = [await pool.allocate_private(reservation) for _ in range(2)]
        with pytest.raises(ReservationExhaustedError):
            await pool.allocate_private(reservation)
        await pool.free(spent)
        await pool.cancel(reservation)
        assert (await _counts(pool))[::2] == (0, 0)
        await pool.check_invariants()


@ASYNCIO_ONLY
@pytest.mark.anyio
async def test_an_unread_allocate_cached_found_meanwhile_stays_and_the_unit_comes_back() -> None:
    states: list[PoolState] = []
    async with open_pool(8, extensions=[_capture(states)]) as pool:
        (state,) = states
        outcome = await pool.reserve([], 2)
        assert outcome is not None
        reservation = outcome.reservation
        refs = state.pool.num_active_refs()
        task = asyncio.ensure_future(pool.allocate_cached(reservation, 77))
        # Queued right behind it: another request finds the new copy before the
        # caller can read its reply...
        finder = asyncio.ensure_future(pool.admit([77]))
        while state.pool.num_active_refs() < refs + 2:  # the actor has replied to both
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()  # ... so the undo cannot take the copy out of the pool
        other = await finder
        assert other is not None
        assert other.cached == 1
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _counts(pool) == (3, 0, 1)  # the copy (held) + 2 reserved units
        spent = [await pool.allocate_private(reservation) for _ in range(2)]
        with pytest.raises(ReservationExhaustedError):
            await pool.allocate_private(reservation)
        await pool.free(spent)
        await pool.cancel(reservation)
        await pool.free(other.blocks)
        assert await _counts(pool) == (0, 1, 0)  # the copy stays cached, idle
        await pool.check_invariants()


# ------------------------------------------------------------------ close and crash


@ASYNCIO_ONLY
@pytest.mark.anyio
async def test_an_unread_reply_at_close_is_still_undone() -> None:
    states: list[PoolState] = []
    tasks: list[asyncio.Future[Any]] = []
    async with open_pool(8, extensions=[_capture(states)]) as pool:
        (state,) = states
        task = asyncio.ensure_future(pool.admit([1, 2], 1))
        tasks.append(task)
        while state.pool.num_active() == 0:  # the actor has replied
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()  # the block closes before the caller sees its cancellation
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert (state.pool.num_active(), state.pool.num_active_refs()) == (0, 0)
    state.pool.check_invariants()
    with pytest.raises(PoolClosedError):
        await pool.stats()


@ASYNCIO_ONLY
@pytest.mark.anyio
async def test_an_unread_manager_allocation_at_close_is_still_undone() -> None:
    managers: list[KvManager] = []
    tasks: list[asyncio.Future[Any]] = []
    async with open_manager(8, 4, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("a", list(range(12)))
        tasks.append(asyncio.ensure_future(kv.allocate("a", 12)))
        while manager.num_blocks("a") == 0:
            await asyncio.sleep(0)
        assert not tasks[0].done()
        tasks[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert manager.num_blocks("a") == 0
    assert manager.pool.num_active() == 0
    manager.check_invariants()


class Explode(msgspec.Struct, frozen=True, tag=True):
    """A test-only message whose handler is a bug."""


def _bomb(state: PoolState) -> dict[type, Handler[Any, Any]]:
    def explode(message: Explode) -> None:
        raise ZeroDivisionError("deliberately broken")

    return {Explode: Handler(explode)}


def _queued(actor: Actor) -> int:
    return actor._receive.statistics().current_buffer_used


@pytest.mark.anyio
async def test_a_crash_fails_every_queued_call_and_waiter_with_its_cause() -> None:
    state = PoolState(BlockPool(4))
    table = {**state.table(), **_bomb(state)}
    actor = Actor(table, current_slots(), POOL_ACTOR)  # started once everything is queued
    hold = state.admit(Admit([], 4)).admission  # type: ignore[union-attr]
    assert hold is not None
    outcomes: dict[str, Any] = {}

    async def record(name: str, message: Any) -> None:
        try:
            outcomes[name] = await actor.call(message)
        except (PoolCrashedError, PoolClosedError) as exc:
            outcomes[name] = exc

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            plan = [
                ("before", QueryPrefix(1)),
                ("waiter", Admit([], 2, True)),
                ("bomb", Explode()),
                ("queued stats", GetStats()),
                ("queued admit", Admit([], 1, False)),
            ]
            for count, (name, message) in enumerate(plan, 1):
                tg.start_soon(record, name, message)
                while _queued(actor) < count:
                    await anyio.lowlevel.checkpoint()
            tg.start_soon(actor.run)
    cause = actor.crash_cause
    assert isinstance(cause, ZeroDivisionError)
    assert type(outcomes.pop("before")).__name__ == "PrefixHitReply"
    for name, outcome in outcomes.items():
        assert type(outcome) is PoolCrashedError, name
        assert outcome.__cause__ is cause, name
    with pytest.raises(PoolCrashedError) as later:
        await actor.call(GetStats())
    assert later.value.__cause__ is cause
    # Nothing queued behind the bomb ran.
    assert (state.pool.num_active(), state.pool.num_active_refs()) == (4, 4)


@pytest.mark.anyio
async def test_open_pool_raises_the_crash_itself_not_a_group() -> None:
    clients: list[PoolClient] = []
    bomb_errors: list[BaseException] = []

    async def bomb(pool: PoolClient) -> None:
        try:
            await pool.call(Explode())
        except PoolCrashedError as exc:
            bomb_errors.append(exc)

    async def crash_it() -> None:
        async with open_pool(4, extensions=[_bomb]) as pool:
            clients.append(pool)
            async with anyio.create_task_group() as tg:
                tg.start_soon(bomb, pool)
                await anyio.sleep_forever()  # cancelled by the crash

    with anyio.fail_after(HANG_GUARD), pytest.raises(PoolCrashedError) as crashed:
        await crash_it()
    assert type(crashed.value) is PoolCrashedError
    assert isinstance(crashed.value.__cause__, ZeroDivisionError)
    assert len(bomb_errors) == 1
    assert bomb_errors[0].__cause__ is crashed.value.__cause__
    with pytest.raises(PoolCrashedError):
        await clients[0].admit([], 1)


@ASYNCIO_ONLY
@pytest.mark.anyio
async def test_an_undone_allocate_cached_found_meanwhile_in_a_full_pool_is_a_unit_short() -> None:
    # As above, but the pool has no free or evictable block left when the undo runs:
    # the unit cannot come back without taking the finder's block, so (as the contract
    # in kvpool.actors says) the reservation stays one unit short of its client's view.
    states: list[PoolState] = []
    async with open_pool(3, extensions=[_capture(states)]) as pool:
        (state,) = states
        outcome = await pool.reserve([], 2)
        assert outcome is not None
        reservation = outcome.reservation
        filler = await pool.admit([], 1)  # the third and last block
        assert filler is not None
        refs = state.pool.num_active_refs()
        task = asyncio.ensure_future(pool.allocate_cached(reservation, 77))
        finder = asyncio.ensure_future(pool.admit([77]))  # a full hit: needs no block
        while state.pool.num_active_refs() < refs + 2:
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        other = await finder
        assert other is not None
        assert reservation.fresh == 2  # the caller never saw the allocation
        assert await pool.prefix_hit(77) is not None  # the finder keeps its block
        assert await _counts(pool) == (3, 0, 2)  # filler, the found copy, one unit
        spent = await pool.allocate_private(reservation)
        with pytest.raises(ReservationExhaustedError):
            await pool.allocate_private(reservation)
        await pool.free([spent])
        await pool.cancel(reservation)
        await pool.free([*other.blocks, *filler.blocks])
        assert await _counts(pool) == (0, 1, 0)  # the found copy stays cached, idle
        await pool.check_invariants()
