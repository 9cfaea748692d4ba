"""The actor's contract at its edges (`kvpool.actors`), one regression test per edge.

- a handler that raises CancelledError is a bug: a crash, never a bare cancellation;
- a give-back refused before it was posted changes none of the client's bookkeeping;
- an unread events reply is put back before anyone else drains newer events;
- an undo that raises on the mid-turn path crashes the actor like any other bug;
- the actor closes its mailbox streams (no ResourceWarning);
- a give-back in an already-cancelled scope takes effect and raises the cancellation,
  on every loop; ``Lease.free()`` with nothing left is a checkpoint too.

Ctrl-C on trio has its own module (tests/actors/test_actor_interrupts.py).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
import sniffio

from kvpool.actors import Handler, PoolClient, PoolState, Status, open_actor, open_pool
from kvpool.errors import PoolCrashedError, WrongLoopError
from kvpool.events import BlockRemoved, BlockStored, KVEvent
from kvpool.manager import KvManager, ManagerClient, StepUpdate, open_manager
from kvpool.manager.operations import ManagerState
from kvpool.pool import BlockPool

pytestmark = pytest.mark.anyio
HANG_GUARD = 60  # seconds; a guard against hangs, never a timing assertion
BS = 4


@pytest.fixture
def asyncio_only(anyio_backend: tuple[str, dict[str, Any]]) -> None:
    """For the edges only asyncio has: a task cancelled after its reply arrived."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("trio never cancels a task its reply already rescheduled")


def _capture(states: list[PoolState]) -> Callable[[PoolState], dict[type, Handler[Any, Any]]]:
    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return {}

    return extension


async def _counts(pool: PoolClient) -> tuple[int, int, int]:
    stats = await pool.stats()
    return stats.num_active, stats.num_inactive, stats.num_active_refs


# ---------------------------------------------- a handler's CancelledError is a bug


class Explode(msgspec.Struct, frozen=True, tag=True):
    """A handler bug that raises CancelledError."""


def _exploding(state: PoolState) -> dict[type, Handler[Any, Any]]:
    def explode(message: Explode) -> None:
        raise asyncio.CancelledError("a bug, not a cancellation")

    return {Explode: Handler(explode)}


@pytest.mark.usefixtures("asyncio_only")
async def test_a_handler_raising_cancelled_error_crashes_the_pool() -> None:
    caught: list[BaseException] = []
    callers: list[asyncio.Future[None]] = []

    async def body() -> None:
        async with open_pool(4, extensions=[_exploding]) as pool:
            callers.append(asyncio.ensure_future(_outcome_of(pool.call(Explode()), caught)))
            with anyio.fail_after(HANG_GUARD):
                await anyio.sleep_forever()  # the crash cancels the body

    with pytest.raises(PoolCrashedError) as raised:
        await body()
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    await callers[0]
    assert len(caught) == 1
    assert isinstance(caught[0], PoolCrashedError)


@pytest.mark.usefixtures("asyncio_only")
async def test_inside_a_task_group_the_crash_is_not_lost() -> None:
    callers: list[asyncio.Future[None]] = []

    async def use_pool() -> None:
        async with open_pool(4, extensions=[_exploding]) as pool:
            callers.append(asyncio.ensure_future(_outcome_of(pool.call(Explode()), [])))
            await anyio.sleep_forever()

    async def run_group() -> None:
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(use_pool)

    with pytest.raises(BaseExceptionGroup) as raised:
        await run_group()
    assert raised.group_contains(PoolCrashedError)
    await callers[0]


# ------------------------------ a give-back refused before posting changes nothing


def _from_another_thread(call: Callable[[], Awaitable[Any]], backend: str) -> BaseException:
    """Run ``call`` on a loop of its own in another thread; return what it raised."""
    errors: list[BaseException] = []

    async def use() -> None:
        try:
            await call()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=lambda: anyio.run(use, backend=backend))
    thread.start()
    thread.join(HANG_GUARD)
    assert len(errors) == 1
    return errors[0]


@pytest.mark.parametrize("thread_backend", ["asyncio", "trio"])
async def test_a_cancel_refused_from_another_thread_leaves_the_reservation_open(
    thread_backend: str,
) -> None:
    async with open_pool(6) as pool:
        async with pool.reservation([], 3) as outcome:
            assert outcome is not None
            reservation = outcome.reservation
            error = await anyio.to_thread.run_sync(
                _from_another_thread, lambda: pool.cancel(reservation), thread_backend
            )
            assert isinstance(error, WrongLoopError)
            assert not reservation.closed
            assert (reservation.fresh, reservation.prefix_len) == (3, 0)
        # The exit cancelled it for real: all six blocks fit again.
        assert reservation.closed
        admission = await pool.admit([], 6)
        assert admission is not None
        await pool.free(admission.blocks)


@pytest.mark.parametrize("thread_backend", ["asyncio", "trio"])
async def test_a_lease_free_refused_from_another_thread_keeps_the_blocks(
    thread_backend: str,
) -> None:
    async with open_pool(6) as pool:
        async with pool.lease([1, 2], 1) as lease:
            held = list(lease.blocks)
            error = await anyio.to_thread.run_sync(
                _from_another_thread, lambda: lease.free(2), thread_backend
            )
            assert isinstance(error, WrongLoopError)
            assert lease.blocks == held
            assert await _counts(pool) == (3, 0, 3)
        assert await _counts(pool) == (0, 0, 0)  # the exit freed all three
        await pool.check_invariants()


# ------------------------------------------ an unread events reply keeps the order


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """Cancel the named task from inside a turn, as a signal handler can."""

    name: str


def _with_cancel(
    table: dict[type, Handler[Any, Any]], tasks: dict[str, asyncio.Task[Any]]
) -> dict[type, Handler[Any, Any]]:
    def cancel(message: Cancel) -> None:
        tasks[message.name].cancel()

    return {**table, Cancel: Handler(cancel)}


def _resident_view(events: list[KVEvent]) -> set[int]:
    """What a router applying ``events`` in order believes resident."""
    resident: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            resident.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            resident.difference_update(event.block_hashes)
    return resident


@pytest.mark.usefixtures("asyncio_only")
@pytest.mark.parametrize("drain", ["take_events", "finish_step"])
async def test_two_drainers_see_the_events_in_the_order_they_were_made(drain: str) -> None:
    """A's drain is delivered, then a turn in the same batch cancels A before it reads
    it and evicts what A's events stored, then B drains: A's events must reach B (or a
    later drain) ahead of the eviction, never after it."""
    manager = KvManager(BlockPool(4), BS)
    tasks: dict[str, asyncio.Task[Any]] = {}
    async with open_actor(_with_cancel(ManagerState(manager).table(), tasks)) as actor:
        kv = ManagerClient(actor, 4, BS)
        await kv.add_request("old", list(range(8)))
        assert await kv.allocate("old", 8, cache=True) is not None  # Stored(old's 2)
        await kv.free("old")  # idle now: the next allocation evicts them
        await kv.add_request("new", list(range(100, 116)))

        async def first_drain() -> list[KVEvent]:
            if drain == "take_events":
                return await kv.take_events()
            return (await kv.finish_step([])).events

        read: list[list[KVEvent]] = []

        async def second_drain() -> None:
            read.append(await kv.take_events())

        # All in one batch: A drains, A is cancelled with its reply unread, "new" evicts
        # "old"'s blocks (Removed), B drains.
        tasks["a"] = asyncio.ensure_future(first_drain())
        calls = [
            asyncio.ensure_future(actor.call(Cancel("a"))),
            asyncio.ensure_future(kv.allocate("new", 16)),
            asyncio.ensure_future(second_drain()),
        ]
        with anyio.fail_after(HANG_GUARD):
            with pytest.raises(asyncio.CancelledError):
                await tasks["a"]
            await asyncio.gather(*calls)
        read.append(await kv.take_events())
        stream = [event for batch in read for event in batch]
        assert any(isinstance(event, BlockRemoved) for event in stream)
        # In production order, Stored(old) comes before Removed(old): nothing of "old"
        # is believed resident once the stream is applied.
        assert _resident_view(stream) == set()
        await kv.free("new")
        await kv.check_invariants()


# ------------------------------------------ an undo raising mid-turn is a crash


class Grab(msgspec.Struct, frozen=True, tag=True):
    """Admit a block while cancelling the caller mid-turn; its undo is buggy."""


@pytest.mark.usefixtures("asyncio_only")
async def test_an_undo_raising_on_the_mid_turn_path_crashes_the_actor() -> None:
    callers: list[asyncio.Task[Any]] = []

    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        def grab(message: Grab) -> list[int]:
            callers[0].cancel()  # what asyncio's Ctrl-C handler does to the main task
            admission = state.pool.admit([], 1)
            assert admission is not None
            return list(admission.blocks)

        def undo(message: Grab, blocks: list[int]) -> None:
            raise RuntimeError("a buggy undo")

        return {Grab: Handler(grab, undo=undo)}

    actors: list[Any] = []
    later: list[BaseException] = []
    queued: list[asyncio.Future[None]] = []

    async def body() -> None:
        async with open_pool(4, extensions=[extension]) as pool:
            actors.append(pool._actor)
            callers.append(asyncio.ensure_future(pool.call(Grab())))
            queued.append(asyncio.ensure_future(_outcome_of(pool.stats(), later)))  # same batch
            with anyio.fail_after(HANG_GUARD):
                await anyio.sleep_forever()  # the crash cancels the body

    with pytest.raises(PoolCrashedError) as raised:
        await body()
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert actors[0].status is Status.CRASHED
    await queued[0]
    assert callers[0].cancelled()
    assert len(later) == 1
    assert isinstance(later[0], PoolCrashedError)


async def _outcome_of(call: Awaitable[Any], errors: list[BaseException]) -> None:
    try:
        await call
    except BaseException as exc:
        errors.append(exc)


# ------------------------------------------------------ no unclosed streams


async def test_pools_and_managers_close_their_mailbox_streams() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with open_pool(4) as pool:
            await pool.stats()
        async with open_manager(4, BS) as kv:
            await kv.usage()
        with pytest.raises(PoolCrashedError):
            async with open_pool(4, extensions=[_buggy]) as pool:
                await pool.call(Explode())
        del pool, kv
        gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def _buggy(state: PoolState) -> dict[type, Handler[Any, Any]]:
    def explode(message: Explode) -> None:
        raise RuntimeError("a bug")

    return {Explode: Handler(explode)}


# ------------------------------- a give-back in an already-cancelled scope raises


async def test_a_give_back_in_a_cancelled_scope_takes_effect_and_raises() -> None:
    managers: list[KvManager] = []
    async with open_pool(8) as pool, open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("a", list(range(8)))
        await kv.add_request("b", list(range(20, 28)))
        assert await kv.allocate("a", 8) is not None
        assert await kv.allocate("b", 8) is not None
        admission = await pool.admit([], 3)
        outcome = await pool.reserve([], 2)
        assert admission is not None
        assert outcome is not None
        Check = Callable[[], Awaitable[bool]]
        on_pool: list[tuple[Callable[[], Awaitable[Any]], Check]] = [
            (lambda: pool.release(admission.blocks[2]), lambda: _active_is(pool, 4)),  # 2 reserved
            (lambda: pool.free(admission.blocks[:2]), lambda: _active_is(pool, 2)),
            (lambda: pool.cancel(outcome.reservation), lambda: _fits(pool, 8)),
        ]
        on_manager: list[tuple[Callable[[], Awaitable[Any]], Check]] = [
            (lambda: kv.preempt("a"), lambda: _true(manager.num_blocks("a") == 0)),
            (lambda: kv.free("a"), lambda: _true("a" not in manager)),
            (
                lambda: kv.finish_step([StepUpdate("b", [], -1, True)]),
                lambda: _true("b" not in manager),
            ),
        ]
        for ready, give_backs in [(pool.stats, on_pool), (kv.usage, on_manager)]:
            for give_back, took_effect in give_backs:
                # The actor has just answered, so it is ready to run when the call
                # posts: the reply can arrive before the cancellation is delivered.
                await ready()
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await give_back()
                    pytest.fail("a give-back in a cancelled scope returned")  # pragma: no cover
                assert scope.cancelled_caught
                await ready()
                assert await took_effect(), give_back
        await pool.check_invariants()
        await kv.check_invariants()


async def _active_is(pool: PoolClient, count: int) -> bool:
    return (await pool.stats()).num_active == count


async def _fits(pool: PoolClient, count: int) -> bool:
    admission = await pool.admit([], count)
    if admission is None:
        return False
    await pool.free(admission.blocks)
    return True


async def _true(value: bool) -> bool:
    return value


async def test_an_empty_lease_free_is_a_checkpoint() -> None:
    async with open_pool(4) as pool:
        async with pool.lease([1]) as lease:
            blocks = lease.detach()
            if sniffio.current_async_library() == "trio":
                import trio

                task = trio.lowlevel.current_task()
                before = (task._cancel_points, task._schedule_points)  # type: ignore[attr-defined]
                await lease.free()
                after = (task._cancel_points, task._schedule_points)  # type: ignore[attr-defined]
                assert after[0] > before[0]
                assert after[1] > before[1]
            with anyio.CancelScope() as scope:
                scope.cancel()
                await lease.free()  # a cancel point: raises here
                pytest.fail("an empty free is not a cancel point")  # pragma: no cover
            assert scope.cancelled_caught
        await pool.free(blocks)
        assert await _counts(pool) == (0, 0, 0)


# ------------------------------------------ an undone call keeps the LRU order


def _evicted_order(pool: BlockPool) -> list[int]:
    """The idle hashes, oldest first (found by evicting them all)."""
    outcome = pool.reserve([], pool.capacity)
    assert outcome is not None
    pool.cancel(outcome.reservation)
    return list(outcome.removed)


@pytest.mark.usefixtures("asyncio_only")
@pytest.mark.parametrize("call", ["reserve", "admit"])
async def test_an_unread_reply_is_undone_with_the_lru_order_kept(call: str) -> None:
    states: list[PoolState] = []
    tasks: dict[str, asyncio.Task[Any]] = {}

    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return _with_cancel({}, tasks)

    async with open_pool(8, extensions=[extension]) as pool:
        (state,) = states
        for chain in ([1, 2, 3], [10], [11]):  # idle, oldest first: 3, 2, 1, 10, 11
            admission = await pool.admit(chain)
            assert admission is not None
            await pool.cache_many(list(zip(admission.blocks, chain, strict=True)))
            await pool.free(admission.blocks)
        if call == "reserve":
            tasks["a"] = asyncio.ensure_future(pool.reserve([1, 2], 1))
        else:
            tasks["a"] = asyncio.ensure_future(pool.admit([1, 2, 4], 1))
        cancel = asyncio.ensure_future(pool.call(Cancel("a")))  # the same batch
        with anyio.fail_after(HANG_GUARD), pytest.raises(asyncio.CancelledError):
            await tasks["a"]
        await cancel
        stats = await pool.stats()  # the undo ran before this
        assert (stats.num_active, stats.num_active_refs) == (0, 0)
        assert _evicted_order(state.pool) == [3, 2, 1, 10, 11]
        await pool.check_invariants()


@pytest.mark.usefixtures("asyncio_only")
async def test_an_unread_manager_allocation_is_undone_with_the_lru_order_kept() -> None:
    manager = KvManager(BlockPool(8), BS)
    tasks: dict[str, asyncio.Task[Any]] = {}
    async with open_actor(_with_cancel(ManagerState(manager).table(), tasks)) as actor:
        kv = ManagerClient(actor, 8, BS)
        hashes: dict[str, list[int]] = {}
        for rid, prompt in [("x", list(range(12))), ("y", list(range(50, 54)))]:
            await kv.add_request(rid, prompt)
            assert await kv.allocate(rid, len(prompt), cache=True) is not None
            hashes[rid] = manager.block_hashes(rid)
            await kv.free(rid)  # idle, leaf first
        idle = [*hashes["x"][::-1], *hashes["y"]]  # oldest first
        await kv.add_request("z", [*range(8), 99, 98, 97, 96])  # x's first two blocks
        tasks["a"] = asyncio.ensure_future(kv.allocate("z", 12))
        cancel = asyncio.ensure_future(actor.call(Cancel("a")))  # the same batch
        with anyio.fail_after(HANG_GUARD), pytest.raises(asyncio.CancelledError):
            await tasks["a"]
        await cancel
        usage = await kv.usage()  # the undo ran before this
        assert usage.num_active == 0
        assert manager.num_blocks("z") == 0
        assert _evicted_order(manager.pool) == idle
        await kv.free("z")
        await kv.check_invariants()
