"""The call contract's everyday edges, on asyncio, uvloop and trio.

1. Client methods are coroutines: ``tg.start_soon(pool.free, ids)`` works everywhere and
   a forgotten ``pool.free(ids)`` warns "never awaited".
2. A give-back call with an undo (the manager's FinishStep) cancelled while queued is
   applied and its events are put back for the next drain.
3. A refused manager call changes nothing, and a manager's actor exposes no raw pool
   mutation.
4. Every call is a checkpoint whatever other tasks did, and a handing-out call made in
   an already-cancelled scope raises the cancellation and takes no effect, while a
   give-back call in one still takes effect (and raises the cancellation).
"""

from __future__ import annotations

import gc
import inspect
import itertools
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio

from kvpool.actors import PoolClient, open_pool
from kvpool.errors import (
    BlockNotReferencedError,
    InvalidArgumentError,
    PoolClosedError,
    PoolError,
)
from kvpool.events import BlockStored
from kvpool.manager import (
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    KvManager,
    ManagerClient,
    StepUpdate,
    open_manager,
)
from kvpool.messages import (
    ActivatePrefix,
    Admit,
    AllocateCached,
    AllocatePrivate,
    CacheMany,
    CachePrivate,
    Cancel,
    CheckInvariants,
    Free,
    GetStats,
    QueryPrefix,
    Release,
    Reserve,
)
from kvpool.pool import BlockPool

BS = 4

POOL_METHODS = [
    "call",
    "prefix_hit",
    "stats",
    "check_invariants",
    "reserve",
    "activate_prefix",
    "allocate_private",
    "allocate_cached",
    "cancel",
    "cache_private",
    "release",
    "admit",
    "cache_many",
    "free",
]
MANAGER_METHODS = [
    "add_request",
    "append_tokens",
    "prefill_cost",
    "allocate",
    "mark_computed",
    "free",
    "preempt",
    "finish_step",
    "finish_stretch",
    "finish_run",
    "finish_chain",
    "take_events",
    "take_batch",
    "stats",
    "usage",
    "check_invariants",
]


async def _counts(pool: PoolClient) -> tuple[int, int, int]:
    stats = await pool.stats()
    return stats.num_active, stats.num_inactive, stats.num_active_refs


async def _seed_inactive(pool: PoolClient, hashes: list[int]) -> None:
    """Make ``hashes`` resident and idle (the leaf enters the LRU first)."""
    admission = await pool.admit(hashes)
    assert admission is not None
    await pool.cache_many(list(zip(admission.blocks, hashes, strict=True)))
    await pool.free(admission.blocks)


# ------------------------------------------------------------ 1. real coroutines


def test_every_client_method_is_a_coroutine_function() -> None:
    for name in POOL_METHODS:
        assert inspect.iscoroutinefunction(getattr(PoolClient, name)), name
    for name in MANAGER_METHODS:
        assert inspect.iscoroutinefunction(getattr(ManagerClient, name)), name


@pytest.mark.anyio
async def test_start_soon_accepts_a_client_method() -> None:
    async with open_pool(8) as pool:
        admission = await pool.admit([1, 2], 1)
        outcome = await pool.reserve([], 2)
        assert admission is not None
        assert outcome is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.free, admission.blocks)
            tg.start_soon(pool.cancel, outcome.reservation)
            tg.start_soon(pool.prefix_hit, 1)
        assert await _counts(pool) == (0, 0, 0)

    async with open_manager(8, BS) as kv:
        await kv.add_request("r", list(range(8)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(kv.allocate, "r", 8)
        assert (await kv.usage()).num_active == 2
        async with anyio.create_task_group() as tg:
            tg.start_soon(kv.free, "r")
        assert (await kv.usage()).num_active == 0


def _forget_to_await(method: Callable[..., Awaitable[Any]], *args: Any) -> None:
    method(*args)  # the mistake: the coroutine is dropped unawaited
    gc.collect()


@pytest.mark.anyio
async def test_a_forgotten_free_warns_never_awaited_and_frees_nothing() -> None:
    async with open_pool(8) as pool:
        admission = await pool.admit([], 2)
        assert admission is not None
        with pytest.warns(RuntimeWarning, match="never awaited"):
            _forget_to_await(pool.free, admission.blocks)
        # Never awaited, so never posted: the blocks are still held.
        assert await _counts(pool) == (2, 0, 2)
        await pool.free(admission.blocks)
        assert await _counts(pool) == (0, 0, 0)


# ----------------------------------- 2. a queued give-back keeps its undo's events


@pytest.mark.anyio
async def test_a_finish_step_cancelled_while_queued_is_applied_and_its_events_kept() -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("a", list(range(8)))
        await kv.add_request("b", list(range(100, 108)))
        assert await kv.allocate("a", 8) is not None
        assert await kv.allocate("b", 8) is not None
        assert await kv.take_events() == []
        # With the actor parked on its empty mailbox, a step made in a cancelled scope is
        # posted anyway (a give-back) and its caller is gone before the actor reaches it
        # (trio aborts the wait at once; on asyncio anyio's cancellation, scheduled
        # first, cancels the still-pending reply future before the actor wakes), so
        # nobody reads the step's events.
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await kv.finish_step([StepUpdate("a", [], 8, False), StepUpdate("b", [], 8, True)])
        assert scope.cancelled_caught
        await kv.usage()  # queued behind the step: the actor has handled it by now
        # Applied: "a" is computed, "b" freed.
        assert manager.num_computed_tokens("a") == 8
        assert "b" not in manager
        # ... and the Stored events it drained are back for the next drain, in order.
        events = await kv.take_events()
        assert all(isinstance(event, BlockStored) for event in events)
        assert [event.block_hashes for event in events] == [
            manager.block_hashes("a"),
            _hashes_of(list(range(100, 108))),
        ]
        await kv.free("a")
        await kv.check_invariants()


def _stored(events: list[Any]) -> list[int]:
    return [h for event in events if isinstance(event, BlockStored) for h in event.block_hashes]


def _hashes_of(prompt: list[int]) -> list[int]:
    """The full-block hashes a fresh manager computes for ``prompt``."""
    manager = KvManager(BlockPool(8), BS)
    manager.add_request("x", prompt)
    return manager.block_hashes("x")


@pytest.mark.anyio
async def test_a_finish_step_whose_caller_leaves_mid_wait_keeps_its_events() -> None:
    # The same from another task's cancel, landing while the step is queued or waiting.
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        expected: list[int] = []
        read: list[int] = []
        put_back = 0
        for delay in range(6):
            rid = f"r{delay}"
            prompt = list(range(delay * 10, delay * 10 + 8))
            expected += _hashes_of(prompt)
            await kv.add_request(rid, prompt)
            assert await kv.allocate(rid, 8) is not None
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def step(scope: anyio.CancelScope = scope, rid: str = rid) -> None:
                    with scope:
                        outcome = await kv.finish_step([StepUpdate(rid, [], 8, True)])
                        read.extend(_stored(outcome.events))

                tg.start_soon(step)
                for _ in range(delay):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
            await kv.usage()  # queued behind the step
            assert rid not in manager  # applied whatever the delay
            put_back += manager.num_pending_events > 0
        # Each step's Stored events reached a caller (a later step drains what an
        # earlier one put back) or wait here: none lost, none twice.
        kept = _stored(await kv.take_events())
        assert sorted(read + kept) == sorted(expected)
        assert put_back, "no step was cancelled before its caller read the reply"
        await kv.check_invariants()


# --------------------------------------------- 3. a refused manager call changes nothing


def _snapshot(manager: KvManager, hashes: list[int]) -> tuple[Any, ...]:
    pool = manager.pool
    return (
        pool.num_active(),
        pool.num_inactive(),
        pool.num_active_refs(),
        [pool.prefix_hit(h) for h in hashes],
        {rid: manager.block_table(rid) for rid in manager},
        {rid: manager.num_computed_tokens(rid) for rid in manager},
        manager.num_pending_events,
        manager.stats(),
    )


def _request_with_a_block_released_behind_its_back(
    released: int,
) -> tuple[BlockPool, KvManager, list[int]]:
    pool = BlockPool(8)
    manager = KvManager(pool, BS)
    manager.add_request("r", list(range(12)))
    assert manager.allocate("r", 12) is not None
    manager.mark_computed("r", 12)
    manager.take_events()
    table = manager.block_table("r")
    hashes = manager.block_hashes("r")
    pool.release(table[released])  # behind the manager's back
    return pool, manager, hashes


@pytest.mark.parametrize("released", [0, 1, 2])
def test_a_refused_free_changes_nothing(released: int) -> None:
    pool, manager, hashes = _request_with_a_block_released_behind_its_back(released)
    before = _snapshot(manager, hashes)
    with pytest.raises(BlockNotReferencedError):
        manager.free("r")
    assert _snapshot(manager, hashes) == before
    # The leaf in particular is still held by the request (a free releases it first).
    assert pool.prefix_hit(hashes[-1]) == before[3][-1]
    assert "r" in manager
    pool.check_invariants()  # (the manager's own check would see the table out of step)


@pytest.mark.parametrize("released", [0, 1, 2])
def test_a_refused_preempt_changes_nothing(released: int) -> None:
    pool, manager, hashes = _request_with_a_block_released_behind_its_back(released)
    before = _snapshot(manager, hashes)
    with pytest.raises(BlockNotReferencedError):
        manager.preempt("r")
    assert _snapshot(manager, hashes) == before  # counters included: no preemption counted
    pool.check_invariants()


POOL_MESSAGES = [
    Release(1),
    Free([1]),
    Admit([1, 2], 0, False),
    Reserve([], 1),
    Cancel(1),
    CachePrivate(1, 5),
    CacheMany([(1, 5)]),
    AllocatePrivate(1),
    AllocateCached(1, 5),
    ActivatePrefix(1),
    QueryPrefix(1),
    GetStats(),
    CheckInvariants(),
]


@pytest.mark.anyio
@pytest.mark.parametrize("message", POOL_MESSAGES, ids=lambda m: type(m).__name__)
async def test_a_managers_actor_refuses_pool_level_messages(message: Any) -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("r", list(range(8)))
        allocation = await kv.allocate("r", 8)
        assert allocation is not None
        before = _snapshot(manager, manager.block_hashes("r"))
        with pytest.raises(InvalidArgumentError, match="no handler"):
            await kv._call(message)
        assert _snapshot(manager, manager.block_hashes("r")) == before
        await kv.check_invariants()


# ------------------------------------------------------- 4. every call a checkpoint


async def _is_checkpoint(call: Callable[[], Awaitable[Any]]) -> bool:
    """Whether ``call`` (refused or not) passed a schedule point and a cancel point.

    On trio, read the task's own counters (what ``trio.testing.assert_checkpoints``
    reads), since trio runs a batch of ready tasks in random order. On asyncio, whose
    ready queue is FIFO, an always-ready task runs at every yield of this one.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        task = trio.lowlevel.current_task()
        before = (task._cancel_points, task._schedule_points)  # type: ignore[attr-defined]
        with suppress(PoolError):
            await call()
        after = (task._cancel_points, task._schedule_points)  # type: ignore[attr-defined]
        return after[0] > before[0] and after[1] > before[1]
    return await _ticks_during(call) >= 1


async def _ticks_during(call: Callable[[], Awaitable[Any]]) -> int:
    """How many times an always-ready task ran while this one made ``call`` (asyncio)."""
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        while ticks == 0:
            await anyio.lowlevel.checkpoint()
        before = ticks
        with suppress(PoolError):  # a refused call is a checkpoint too
            await call()
        ran = ticks - before
        done = True
    return ran


@pytest.mark.anyio
async def test_every_pool_call_is_a_checkpoint_refused_or_not() -> None:
    async with open_pool(8) as pool:
        await _seed_inactive(pool, [1, 2])
        admission = await pool.admit([3], 1)
        assert admission is not None
        outcome = await pool.reserve([1], 3)
        assert outcome is not None
        res = outcome.reservation
        async with open_pool(2) as other:
            foreign = await other.reserve([], 1)
        assert foreign is not None
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "prefix_hit": lambda: pool.prefix_hit(1),
            "stats": pool.stats,
            "check_invariants": pool.check_invariants,
            "admit": lambda: pool.admit([1], 1),
            "admit that does not fit": lambda: pool.admit([], 7),
            "cache_many": lambda: pool.cache_many([(admission.blocks[0], 3)]),
            "cache_private refused": lambda: pool.cache_private(admission.blocks[0], 4),
            "activate_prefix": lambda: pool.activate_prefix(res),
            "allocate_private": lambda: pool.allocate_private(res),
            "allocate_cached": lambda: pool.allocate_cached(res, 9),
            "release": lambda: pool.release(admission.blocks[1]),
            "release refused": lambda: pool.release(admission.blocks[1]),
            "free refused": lambda: pool.free([12345]),
            "cancel": lambda: pool.cancel(res),
            "cancel refused": lambda: pool.cancel(res),
            "foreign reservation": lambda: pool.allocate_private(foreign.reservation),
            "not a reservation": lambda: pool.cancel("r"),  # type: ignore[arg-type]
            "unknown kind": lambda: pool.call(object()),
        }
        for name, call in calls.items():
            assert await _is_checkpoint(call), name
    # After the pool closed, a refused call still yields.
    assert await _is_checkpoint(pool.stats)
    with pytest.raises(PoolClosedError):
        await pool.stats()


@pytest.mark.anyio
async def test_every_manager_call_is_a_checkpoint() -> None:
    async with open_manager(8, BS) as kv:
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: kv.add_request("r", list(range(8))),
            lambda: kv.add_request("r", [1]),  # refused: a duplicate
            lambda: kv.append_tokens("r", [1]),
            lambda: kv.prefill_cost("r"),
            lambda: kv.allocate("r", 8),
            lambda: kv.mark_computed("r", 8),
            lambda: kv.finish_step([StepUpdate("r", [], -1, False)]),
            kv.take_events,
            kv.take_batch,
            kv.stats,
            kv.usage,
            kv.check_invariants,
            lambda: kv.preempt("r"),
            lambda: kv.free("r"),
            lambda: kv.free("r"),  # refused: a double free
        ]
        for index, call in enumerate(calls):
            assert await _is_checkpoint(call), index


@pytest.mark.anyio
async def test_a_caller_yields_on_every_call_whatever_others_did_before() -> None:
    async with open_pool(8) as pool:
        # Other tasks make many calls first: no budget of the actor's is spent by them.
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(_many_queries, pool, 50)
        for _ in range(20):
            assert await _is_checkpoint(lambda: pool.prefix_hit(1))

        # Two tasks calling in a loop take turns: neither completes a run of calls while
        # the other waits (the old per-actor budget let each make 32 in a row). Trio
        # shuffles each batch of ready tasks, so one may complete two calls to the
        # other's one now and then (over 400 calls the lead drifts), but never three in
        # a row; only the last run, once the other task has finished, is longer.
        order: list[str] = []

        async def caller(name: str) -> None:
            for _ in range(200):
                await pool.prefix_hit(1)
                order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, "a")
            tg.start_soon(caller, "b")
        runs = [len(list(run)) for _, run in itertools.groupby(order)]
        assert max(runs[:-1]) <= 3, runs
        assert len(runs) >= 100, runs


async def _many_queries(pool: PoolClient, count: int) -> None:
    for _ in range(count):
        await pool.prefix_hit(1)


def _cancelled() -> type[BaseException]:
    return anyio.get_cancelled_exc_class()


async def _in_cancelled_scope(call: Callable[[], Awaitable[Any]]) -> None:
    """Make ``call`` in an already-cancelled scope; it must raise the cancellation."""
    raised: list[BaseException] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await call()
        except _cancelled() as exc:
            raised.append(exc)
            raise
    assert scope.cancelled_caught
    assert raised, "the call returned instead of raising the cancellation"


async def _give_back_in_cancelled_scope(call: Callable[[], Awaitable[Any]]) -> None:
    """Make a give-back ``call`` in an already-cancelled scope, without a shield.

    It is posted and takes effect; whether its caller then sees the cancellation or its
    reply depends on whether the actor replied before the cancellation landed.
    """
    with anyio.CancelScope() as scope:
        scope.cancel()
        await call()


async def _pool_snapshot(pool: PoolClient, hashes: list[int]) -> tuple[Any, ...]:
    stats = await pool.stats()
    hits = [await pool.prefix_hit(h) for h in hashes]
    return stats, hits


@pytest.mark.anyio
async def test_handing_out_calls_in_a_cancelled_scope_raise_and_take_no_effect() -> None:
    async with open_pool(6) as pool:
        hashes = [1, 2, 3, 4]
        await _seed_inactive(pool, hashes)  # 4 idle copies, 2 free: admits below evict
        outcome = await pool.reserve([1], 2)
        assert outcome is not None
        res = outcome.reservation
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "admit": lambda: pool.admit([7, 8], 3),
            "admit wait": lambda: pool.admit([7, 8], 3, wait=True),
            "reserve": lambda: pool.reserve([2], 3),
            "prefix_hit": lambda: pool.prefix_hit(1),
            "stats": pool.stats,
            "activate_prefix": lambda: pool.activate_prefix(res),
            "allocate_private": lambda: pool.allocate_private(res),
            "allocate_cached": lambda: pool.allocate_cached(res, 9),
            "cache_many": lambda: pool.cache_many([]),
        }
        before = await _pool_snapshot(pool, [*hashes, 7, 8, 9])
        for name, call in calls.items():
            await _in_cancelled_scope(call)
            assert await _pool_snapshot(pool, [*hashes, 7, 8, 9]) == before, name
        stats, _hits = before
        assert stats.evictions == 0
        # The reservation still holds what it held.
        assert (res.prefix_len, res.fresh) == (1, 2)
        assert await pool.activate_prefix(res) != []
        await pool.cancel(res)


@pytest.mark.anyio
async def test_giving_back_in_a_cancelled_scope_takes_effect_without_a_shield() -> None:
    async with open_pool(8) as pool:
        admission = await pool.admit([], 3)
        outcome = await pool.reserve([], 2)
        assert admission is not None
        assert outcome is not None
        await _give_back_in_cancelled_scope(lambda: pool.release(admission.blocks[2]))
        assert await _counts(pool) == (4, 0, 2)
        await _give_back_in_cancelled_scope(lambda: pool.free(admission.blocks[:2]))
        assert await _counts(pool) == (2, 0, 0)
        await _give_back_in_cancelled_scope(lambda: pool.cancel(outcome.reservation))
        assert await _counts(pool) == (0, 0, 0)
        # A lease's exit in a cancelled task frees what it holds.
        with anyio.CancelScope() as scope:
            async with pool.lease([5, 6]) as lease:
                assert len(lease.blocks) == 2
                scope.cancel()
                await anyio.sleep_forever()
        assert await _counts(pool) == (0, 0, 0)


@pytest.mark.anyio
async def test_manager_calls_in_a_cancelled_scope() -> None:
    managers: list[KvManager] = []
    async with open_manager(4, BS, on_create=managers.append) as kv:
        (manager,) = managers
        # Two idle cached blocks: "b"'s allocation of 3 blocks would evict one.
        await kv.add_request("seed", list(range(8)))
        assert await kv.allocate("seed", 8) is not None
        await kv.mark_computed("seed", 8)
        await kv.free("seed")
        await kv.take_events()
        await kv.add_request("b", list(range(50, 62)))
        await kv.add_request("c", list(range(70, 74)))
        assert await kv.allocate("c", 4) is not None
        seeded = _hashes_of(list(range(8)))

        def state() -> tuple[Any, ...]:
            return (*_snapshot(manager, seeded), manager.pool.evictions)

        before = state()
        for call in [
            lambda: kv.allocate("b", 12),
            lambda: kv.allocate("b", 12, wait=True),
            lambda: kv.add_request("d", [1, 2]),
            lambda: kv.take_events(),
            lambda: kv.prefill_cost("b"),
        ]:
            await _in_cancelled_scope(call)
            assert state() == before
        assert manager.pool.evictions == 0
        # Give-backs take effect.
        # Give-backs take effect (each checked after a round trip queued behind it).
        await _give_back_in_cancelled_scope(lambda: kv.preempt("c"))
        assert (await kv.stats()).preemptions == 1
        assert manager.num_blocks("c") == 0
        await _give_back_in_cancelled_scope(lambda: kv.free("c"))
        await kv.usage()
        assert "c" not in manager
        await _give_back_in_cancelled_scope(lambda: kv.finish_step([StepUpdate("b", [], -1, True)]))
        await kv.usage()
        assert "b" not in manager
        assert (await kv.usage()).num_active == 0
        await kv.check_invariants()


@pytest.mark.anyio
async def test_a_finish_stretch_in_a_cancelled_scope_frees_and_allocates_nothing() -> None:
    """A `finish_stretch` gives blocks back, so in a cancelled scope it is posted and its
    frees take effect; what its stretch allocated goes back (nobody reads the reply),
    so the survivor's table is as before."""
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        for name, first in (("a", 0), ("b", 100)):
            await kv.add_request(name, list(range(first, first + 3)))
            assert await kv.allocate(name, 3, cache=True) is not None
        await kv.take_events()
        # a's first block fills, then its table grows by one; b finishes
        stretch = DecodeStretch(["a"], [[7, 8]], [0, 0], [4, 5], [1, 1], [1, 2])
        await anyio.wait_all_tasks_blocked()
        await _give_back_in_cancelled_scope(
            lambda: kv.finish_stretch(stretch, [StepUpdate("b", [], -1, True)])
        )
        await kv.usage()  # queued behind it: the actor has handled it by now
        assert "b" not in manager
        assert manager.num_blocks("a") == 1
        await kv.free("a")
        assert (await kv.usage()).num_active == 0
        await kv.check_invariants()


@pytest.mark.anyio
async def test_a_finish_run_in_a_cancelled_scope_frees_and_allocates_nothing() -> None:
    """`finish_run` as `finish_stretch`: in a cancelled scope its frees take effect and
    what its run allocated goes back."""
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        for name, first in (("a", 0), ("b", 100)):
            await kv.add_request(name, list(range(first, first + 3)))
            assert await kv.allocate(name, 3, cache=True) is not None
        await kv.take_events()
        # a's first block fills at step 0, its table grows at step 1; b finishes
        run = DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2)
        await anyio.wait_all_tasks_blocked()
        await _give_back_in_cancelled_scope(
            lambda: kv.finish_run(run, [StepUpdate("b", [], -1, True)])
        )
        await kv.usage()  # queued behind it: the actor has handled it by now
        assert "b" not in manager
        assert manager.num_blocks("a") == 1
        await kv.free("a")
        assert (await kv.usage()).num_active == 0
        await kv.check_invariants()


@pytest.mark.anyio
async def test_a_finish_chain_in_a_cancelled_scope_frees_and_allocates_nothing() -> None:
    """`finish_chain` as `finish_run`: in a cancelled scope its frees take effect, and
    what its segments allocated goes back."""
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        for name, first in (("a", 0), ("b", 100), ("c", 200)):
            await kv.add_request(name, list(range(first, first + 3)))
            assert await kv.allocate(name, 3, cache=True) is not None
        await kv.take_events()
        # a and c fill their first blocks at step 0, c leaving then with b; a's table
        # grows at step 1 and again at step 5
        run = DecodeRun(["a", "c"], [[7, 8, 9, 9, 9, 9], [7]], [4, 4], [1, -1], [0, 0], 6)
        chain = DecodeChain(run, [0], [["b", "c"]])
        await anyio.wait_all_tasks_blocked()
        await _give_back_in_cancelled_scope(lambda: kv.finish_chain(chain))
        await kv.usage()  # queued behind it: the actor has handled it by now
        assert "b" not in manager
        assert "c" not in manager
        assert manager.num_blocks("a") == 1
        await kv.free("a")
        assert (await kv.usage()).num_active == 0
        await kv.check_invariants()
