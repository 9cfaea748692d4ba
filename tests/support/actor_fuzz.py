"""A seeded fuzzer for the pool and manager actors: every call, every cancellation mode,
close and crash races, checked after each run.

One run opens a pool (or a manager) and lets a few dozen tasks make random calls, each
under a random cancellation mode (`MODES`). The run ends one of three ways: cleanly (the
tasks finish inside the block), by a close race (the block is left while tasks still
call), or by a crash (a task sends a message whose handler has a bug). After each run:

- no hang (a generous guard), every task finished;
- the pool's invariants hold; a clean run leaks nothing (no block referenced, no unit
  reserved, no reservation handle, no request left, no waiter);
- a crash run raised `ActorCrashedError` (its cause the bug) from the block;
- no warning at all (an unclosed stream, a coroutine never awaited);
- manager runs: every event reached exactly one reader, and read in the order replies
  went out (plus a final drain) they describe exactly what is resident.

Used by tests/test_actor_fuzz.py (a few seconds per loop) and by
benchmarks/fuzz_actor.py (longer runs, printing seeds and counts).
"""

from __future__ import annotations

import asyncio
import gc
import random
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import sniffio

from kvpool.actors import Handler, PoolClient, PoolState, open_actor, open_pool
from kvpool.errors import ActorClosedError, ActorCrashedError, PoolError
from kvpool.events import BlockRemoved, BlockStored, KVEvent
from kvpool.manager import DecodeStretch, KvManager, ManagerClient, SlotRequest, StepUpdate
from kvpool.manager.messages import (
    AllocateSteps,
    AllocateStretch,
    FinishStep,
    TakeBatch,
    TakeEvents,
)
from kvpool.manager.operations import ManagerState
from kvpool.pool import BlockPool

T = TypeVar("T")
MODES = ("none", "pre-cancelled", "cancelled-later", "deadline", "shielded", "native")
"""How a call may be cancelled: not at all, in an already-cancelled scope, by another
task after a few schedule points, by a deadline, inside a shield within a cancelled
scope, and (asyncio only) by a plain ``Task.cancel`` after a few schedule points."""
ENDINGS = ("clean", "clean", "close", "crash")
HANG_GUARD = 120  # seconds; a guard against hangs, never a timing assertion
BS = 4


class Bomb(msgspec.Struct, frozen=True, tag=True):
    """A message whose handler has a bug."""


def _bomb(_message: Bomb) -> None:
    raise ZeroDivisionError("a handler bug")


class _Stop(Exception):
    """The pool is gone (closed or crashed): this task stops."""


@dataclass
class Counts:
    """What the runs did, for the report."""

    runs: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)

    def add(self, other: Counts) -> None:
        self.runs.update(other.runs)
        self.calls.update(other.calls)
        self.outcomes.update(other.outcomes)


class Caller:
    """Makes one call under a random cancellation mode and counts what happened."""

    def __init__(self, rng: random.Random, counts: Counts, helpers: Any) -> None:
        self.rng = rng
        self.counts = counts
        self.helpers = helpers  # a task group for the cancelling tasks
        self.modes = MODES if sniffio.current_async_library() == "asyncio" else MODES[:-1]

    async def __call__(self, name: str, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """(True, reply) if the call returned; (False, None) if it was cancelled or
        refused. Raises `_Stop` once the pool is gone."""
        mode = self.rng.choice(self.modes)
        self.counts.calls[f"{name} / {mode}"] += 1
        try:
            done, reply = await self._in_mode(mode, call)
        except (ActorClosedError, ActorCrashedError) as exc:
            self.counts.outcomes[type(exc).__name__] += 1
            raise _Stop from exc
        except PoolError as exc:
            self.counts.outcomes[f"refused: {type(exc).__name__}"] += 1
            return False, None
        self.counts.outcomes["returned" if done else "cancelled"] += 1
        return done, reply

    async def _in_mode(self, mode: str, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        rng = self.rng
        if mode == "none":
            return True, await call()
        if mode == "shielded":
            with anyio.CancelScope() as outer:
                outer.cancel()
                with anyio.CancelScope(shield=True):
                    return True, await call()
        if mode == "native":
            task = asyncio.ensure_future(call())
            try:
                for _ in range(rng.randint(1, 4)):  # >= 1: the call was made (and posted)
                    await asyncio.sleep(0)
            finally:
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait([task])  # its outcome is always retrieved
            if task.cancelled():
                return False, None
            return True, task.result()
        scope = anyio.CancelScope()
        if mode == "pre-cancelled":
            scope.cancel()
        elif mode == "deadline":
            scope.deadline = anyio.current_time() + rng.choice([0.0, 1e-5, 1e-4, 1e-3])
        else:
            self.helpers.start_soon(_cancel_after, scope, rng.randint(0, 4))
        with scope:
            return True, await call()
        return False, None


async def _cancel_after(scope: anyio.CancelScope, checkpoints: int) -> None:
    for _ in range(checkpoints):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


# --------------------------------------------------------------------- the pool


class PoolTask:
    """One task's random calls on a pool; every give-back it owes it makes."""

    def __init__(self, pool: PoolClient, call: Caller, rng: random.Random, crash: bool) -> None:
        self.pool = pool
        self.call = call
        self.rng = rng
        self.crash = crash

    def chain(self) -> list[int]:
        root = self.rng.randrange(4) * 1000
        return [root + k for k in range(self.rng.randint(1, 5))]

    async def run(self) -> None:
        ops = [self.admit, self.lease, self.reserve, self.reservation_block, self.query]
        try:
            for _ in range(self.rng.randint(2, 6)):
                if self.crash and self.rng.random() < 0.2:
                    await self.call("crash", lambda: self.pool.call(Bomb()))
                await self.rng.choice(ops)()
        except (_Stop, ActorClosedError, ActorCrashedError):
            pass  # the pool is gone (a lease's or a reservation's entry raises it as is)

    async def give_back(self, name: str, call: Callable[[], Awaitable[Any]]) -> None:
        await self.call(name, call)  # it took effect once posted, whatever the outcome

    async def admit(self) -> None:
        pool, rng, chain = self.pool, self.rng, self.chain()
        wait = rng.random() < 0.3
        done, admission = await self.call(
            "admit", lambda: pool.admit(chain, rng.randint(0, 2), wait=wait)
        )
        if not done or admission is None:
            return
        blocks = list(admission.blocks)
        fresh = list(
            zip(blocks[admission.cached : len(chain)], chain[admission.cached :], strict=True)
        )
        if fresh:
            if rng.random() < 0.5:
                await self.call("cache_many", lambda: pool.cache_many(fresh))
            else:
                block, block_hash = fresh[0]
                await self.call("cache_private", lambda: pool.cache_private(block, block_hash))
        if rng.random() < 0.5:
            await self.give_back("free", lambda: pool.free(blocks))
        else:
            for block in reversed(blocks):
                await self.give_back("release", lambda block=block: pool.release(block))

    async def lease(self) -> None:
        pool, rng, chain = self.pool, self.rng, self.chain()
        scope = anyio.CancelScope()
        if rng.random() < 0.3:
            self.call.helpers.start_soon(_cancel_after, scope, rng.randint(0, 6))
        with scope:
            async with pool.lease(chain, rng.randint(0, 2), wait=rng.random() < 0.5) as lease:
                if lease is None:
                    return
                if rng.random() < 0.5:
                    await self.call("lease.free", lambda: lease.free(1))
                await self.call("stats", pool.stats)

    async def reserve(self) -> None:
        pool, rng, chain = self.pool, self.rng, self.chain()
        prefix: list[int] = []
        for block_hash in chain:
            done, hit = await self.call("prefix_hit", lambda h=block_hash: pool.prefix_hit(h))
            if not done or hit is None:
                break
            prefix.append(block_hash)
        done, outcome = await self.call("reserve", lambda: pool.reserve(prefix, rng.randint(0, 3)))
        if not done or outcome is None:
            return
        reservation = outcome.reservation
        owned: list[int] = []
        try:
            if rng.random() < 0.7:
                done, ids = await self.call(
                    "activate_prefix", lambda: pool.activate_prefix(reservation)
                )
                if done and ids:
                    owned += ids
            for _ in range(rng.randint(0, 3)):
                if rng.random() < 0.5:
                    done, block = await self.call(
                        "allocate_private", lambda: pool.allocate_private(reservation)
                    )
                    if done and block is not None:
                        owned.append(block)
                else:
                    block_hash = 5000 + rng.randrange(8)
                    done, pair = await self.call(
                        "allocate_cached",
                        lambda h=block_hash: pool.allocate_cached(reservation, h),  # type: ignore[misc]
                    )
                    if done and pair is not None:
                        owned.append(pair[0])
        finally:
            with anyio.CancelScope(shield=True):
                if owned:
                    await self.give_back("free", lambda: pool.free(owned))
                await self.give_back("cancel", lambda: pool.cancel(reservation))

    async def reservation_block(self) -> None:
        pool, rng = self.pool, self.rng
        async with pool.reservation([], rng.randint(1, 3)) as outcome:
            if outcome is None:
                return
            done, block = await self.call(
                "allocate_private", lambda: pool.allocate_private(outcome.reservation)
            )
            if done and block is not None:
                await self.give_back("release", lambda: pool.release(block))  # type: ignore[arg-type]

    async def query(self) -> None:
        pool = self.pool
        name, call = self.rng.choice(
            [
                ("prefix_hit", lambda: pool.prefix_hit(1000)),
                ("stats", pool.stats),
                ("check_invariants", pool.check_invariants),
            ]
        )
        await self.call(name, call)


def _capture(states: list[PoolState]) -> Callable[[PoolState], dict[type, Handler[Any, Any]]]:
    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return {Bomb: Handler(_bomb)}

    return extension


async def pool_run(seed: int, tasks: int = 32, capacity: int = 24) -> Counts:
    """One seeded pool run; raises AssertionError on any breach."""
    rng = random.Random(seed)
    ending = rng.choice(ENDINGS)
    counts = Counts()
    counts.runs[f"pool {ending}"] += 1
    states: list[PoolState] = []
    raised: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as outside:
                try:
                    async with open_pool(capacity, extensions=[_capture(states)]) as pool:
                        async with anyio.create_task_group() as inside:
                            group = outside if ending == "close" else inside
                            for _ in range(tasks):
                                call = Caller(random.Random(rng.random()), counts, group)
                                task = PoolTask(pool, call, call.rng, ending == "crash")
                                group.start_soon(task.run)
                            if ending == "close":
                                for _ in range(rng.randint(0, 30)):
                                    await anyio.lowlevel.checkpoint()
                        if ending != "close":
                            await _check_pool_clean(pool, states[0])
                except ActorCrashedError as exc:
                    raised = exc
        del pool
        gc.collect()
    _check_no_warnings(caught)
    (state,) = states
    state.pool.check_invariants()
    if raised is not None:
        assert isinstance(raised.__cause__, ZeroDivisionError), raised
        counts.runs["crashed"] += 1
    return counts


async def _check_pool_clean(pool: PoolClient, state: PoolState) -> None:
    stats = await pool.stats()
    assert (stats.num_active, stats.num_active_refs, stats.waiters) == (0, 0, 0), stats
    assert not state._held, state._held
    await pool.check_invariants()


def _check_no_warnings(caught: list[warnings.WarningMessage]) -> None:
    assert not caught, [str(w.message) for w in caught]


# ------------------------------------------------------------------ the manager


@dataclass
class EventLog:
    """Event pieces in the order the actor handed them out, and the ones read."""

    sequence: dict[int, tuple[int, list[KVEvent]]] = field(default_factory=dict)
    read: list[tuple[int, list[KVEvent]]] = field(default_factory=list)

    def handed_out(self, events: list[KVEvent]) -> None:
        self.sequence[id(events)] = (len(self.sequence), events)

    def was_read(self, events: list[KVEvent]) -> None:
        self.read.append(self.sequence[id(events)])


def _logged_table(manager: KvManager, log: EventLog) -> dict[type, Handler[Any, Any]]:
    """The manager's handlers, with every ordered reply's events logged as handed out."""
    table = ManagerState(manager).table()

    def logging(kind: type, pieces: Callable[[Any], list[list[KVEvent]]]) -> None:
        handler = table[kind]

        def handle(message: Any) -> Any:
            reply = handler.handle(message)
            for events in pieces(reply):
                log.handed_out(events)
            return reply

        table[kind] = Handler(handle, handler.undo, handler.gives_back, handler.waits, True)

    logging(TakeEvents, lambda reply: [reply.events])
    logging(TakeBatch, lambda reply: [] if reply.batch is None else [reply.batch.events])
    logging(FinishStep, lambda reply: [reply.events])
    logging(AllocateSteps, lambda reply: [step.events for step in reply.steps])
    logging(AllocateStretch, lambda reply: [events for _, events in reply.events])
    table[Bomb] = Handler(_bomb)
    return table


class ManagerTask:
    """One task's requests through a manager, with drains and queries between."""

    def __init__(
        self, kv: ManagerClient, call: Caller, rng: random.Random, name: str, log: EventLog
    ) -> None:
        self.kv = kv
        self.call = call
        self.rng = rng
        self.name = name
        self.log = log
        self.crash = False

    def prompt(self) -> list[int]:
        root = self.rng.randrange(3) * 100
        return [root + k for k in range(self.rng.randint(3, 14))]

    async def run(self) -> None:
        try:
            for k in range(self.rng.randint(1, 4)):
                if self.crash and self.rng.random() < 0.2:
                    await self.call("crash", lambda: self.kv._call(Bomb()))
                await self.request(f"{self.name}-{k}")
                await self.drain_or_query()
        except (_Stop, ActorClosedError, ActorCrashedError):
            pass

    async def request(self, rid: str) -> None:
        kv, rng = self.kv, self.rng
        prompt = self.prompt()
        done, _ = await self.call("add_request", lambda: kv.add_request(rid, prompt))
        if not done:
            return  # undone, or skipped: the request does not exist
        try:
            wait = rng.random() < 0.3
            done, allocation = await self.call(
                "allocate",
                lambda: kv.allocate(rid, len(prompt), wait=wait, cache=rng.random() < 0.5),
            )
            if done and allocation is not None:
                await self.call("mark_computed", lambda: kv.mark_computed(rid, len(prompt)))
                await self.call("append_tokens", lambda: kv.append_tokens(rid, [7, 8]))
                done, steps = await self.call(
                    "allocate_steps",
                    lambda: kv.allocate_steps([[SlotRequest(rid, len(prompt) + 1)]], rid),
                )
                if done and steps is not None:
                    for step in steps:
                        self.log.was_read(step.events)
                stretch = DecodeStretch(
                    [rid], [[5, 6]], [0, 0], [len(prompt), len(prompt) + 1], [1, 1], [1, 2]
                )
                done, result = await self.call(
                    "allocate_stretch", lambda: kv.allocate_stretch(stretch, rid)
                )
                if done and result is not None:
                    for _, events in result.events:
                        self.log.was_read(events)
                if rng.random() < 0.3:
                    await self.call("preempt", lambda: kv.preempt(rid))
            await self.call("prefill_cost", lambda: kv.prefill_cost(rid))
        finally:
            with anyio.CancelScope(shield=True):
                await self.finish(rid)

    async def finish(self, rid: str) -> None:
        kv = self.kv
        if self.rng.random() < 0.5:
            done, outcome = await self.call(
                "finish_step", lambda: kv.finish_step([StepUpdate(rid, [], -1, True)])
            )
            if done and outcome is not None:
                self.log.was_read(outcome.events)
        else:
            await self.call("free", lambda: kv.free(rid))

    async def drain_or_query(self) -> None:
        kv = self.kv
        choice = self.rng.randrange(6)
        if choice == 0:
            done, events = await self.call("take_events", kv.take_events)
            if done and events is not None:
                self.log.was_read(events)
        elif choice == 1:
            done, batch = await self.call("take_batch", lambda: kv.take_batch(1.0))
            if done and batch is not None:
                self.log.was_read(batch.events)
        elif choice == 2:
            done, outcome = await self.call("finish_step", lambda: kv.finish_step([]))
            if done and outcome is not None:
                self.log.was_read(outcome.events)
        elif choice == 3:
            await self.call("stats", kv.stats)
        elif choice == 4:
            await self.call("usage", kv.usage)
        else:
            await self.call("check_invariants", kv.check_invariants)


async def manager_run(seed: int, tasks: int = 16, capacity: int = 24) -> Counts:
    """One seeded manager run; raises AssertionError on any breach."""
    rng = random.Random(seed)
    ending = rng.choice(ENDINGS)
    counts = Counts()
    counts.runs[f"manager {ending}"] += 1
    manager = KvManager(BlockPool(capacity), BS)
    log = EventLog()
    raised: BaseException | None = None
    final: list[KVEvent] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as outside:
                try:
                    async with open_actor(_logged_table(manager, log)) as actor:
                        kv = ManagerClient(actor, capacity, BS)
                        async with anyio.create_task_group() as inside:
                            group = outside if ending == "close" else inside
                            for k in range(tasks):
                                call = Caller(random.Random(rng.random()), counts, group)
                                task = ManagerTask(kv, call, call.rng, f"t{k}", log)
                                task.crash = ending == "crash"
                                group.start_soon(task.run)
                            if ending == "close":
                                for _ in range(rng.randint(0, 30)):
                                    await anyio.lowlevel.checkpoint()
                        if ending != "close":
                            final = await kv.take_events()
                            usage = await kv.usage()
                            assert (usage.num_active, len(manager)) == (0, 0), usage
                            await kv.check_invariants()
                except ActorCrashedError as exc:
                    raised = exc
        del kv
        gc.collect()
    _check_no_warnings(caught)
    manager.pool.check_invariants()
    if raised is not None:
        assert isinstance(raised.__cause__, ZeroDivisionError), raised
        counts.runs["crashed"] += 1
    elif ending != "close":
        _check_events(manager, log, final)
    return counts


def _check_events(manager: KvManager, log: EventLog, final: list[KVEvent]) -> None:
    """Every event read once; read in hand-out order, they describe the pool exactly."""
    stream = [
        event for _, events in sorted(log.read, key=lambda piece: piece[0]) for event in events
    ]
    stream += final
    assert len({id(event) for event in stream}) == len(stream), "an event was read twice"
    resident: set[int] = set()
    seen: set[int] = set()
    for event in stream:
        if isinstance(event, BlockStored):
            resident.update(event.block_hashes)
            seen.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            resident.difference_update(event.block_hashes)
    for block_hash in seen:
        assert (block_hash in resident) == (manager.pool.prefix_hit(block_hash) is not None), (
            f"hash {block_hash}: the events say {'resident' if block_hash in resident else 'gone'}"
        )


async def fuzz(seeds: range, pool_tasks: int = 32, manager_tasks: int = 16) -> Counts:
    """Run a pool run and a manager run per seed; the counts of all of them."""
    counts = Counts()
    for seed in seeds:
        counts.add(await pool_run(seed, pool_tasks))
        counts.add(await manager_run(seed, manager_tasks))
    return counts
