"""The manager through the pool actor: same answers, typed errors, waiting, cancellation."""

from __future__ import annotations

import asyncio
import functools
import random
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kvpool.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    ManagerClosedError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.events import KVEvent, KVEventBatch, decode_batch, encode_batch
from kvpool.manager import (
    AdmissionGate,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    KvManager,
    ManagerClient,
    QueuedRequest,
    SlotRequest,
    StepUpdate,
    open_manager,
)
from kvpool.manager.messages import (
    AddRequest,
    AllocateRun,
    AllocateSlots,
    AllocateSteps,
    AllocateStretch,
    FinishChain,
    FinishRun,
    FinishStretch,
    ScheduleAfterChain,
    ScheduleStep,
    TakeEvents,
)
from kvpool.manager.operations import ManagerState
from kvpool.pool import BlockPool

BS = 4

# ------------------------------------------------------------------ a script


def script(seed: int) -> list[tuple[str, tuple[Any, ...]]]:
    """A deterministic mix of manager calls, some of them mistakes."""
    rng = random.Random(seed)
    prefix = [rng.randrange(30) for _ in range(9)]
    calls: list[tuple[str, tuple[Any, ...]]] = []
    live: dict[str, int] = {}
    for i in range(40):
        rid = f"r{i}"
        prompt = prefix[: rng.randrange(1, 10)] + [
            rng.randrange(30) for _ in range(rng.randrange(9))
        ]
        calls += [("add_request", (rid, prompt)), ("prefill_cost", (rid,))]
        calls += [("allocate", (rid, len(prompt))), ("mark_computed", (rid, len(prompt)))]
        live[rid] = len(prompt)
        if rng.random() < 0.3:
            calls.append(("add_request", (rid, [1])))  # duplicate
        if rng.random() < 0.3:
            calls.append(("allocate", (rid, live[rid] + 1)))  # beyond its tokens
        victim = rng.choice(sorted(live))
        action = rng.choice(["free", "preempt", "append", "none"])
        if action == "free":
            calls.append(("free", (victim,)))
            del live[victim]
        elif action == "preempt":
            calls.append(("preempt", (victim,)))
        elif action == "append":
            calls.append(("append_tokens", (victim, [rng.randrange(30)])))
            live[victim] += 1
            calls.append(("allocate", (victim, live[victim])))
        calls.append(("take_events", ()))
    calls += [("free", ("nope",)), ("stats", ())]
    return calls


def normalise(value: Any, ids: dict[int, int]) -> Any:
    """Block ids differ between pools (process-wide serials): rename them by first use."""
    if hasattr(value, "block_ids"):
        renamed = [ids.setdefault(b, len(ids)) for b in value.block_ids]
        return (renamed, value.cached_blocks, value.removed)
    return value


@pytest.mark.anyio
async def test_the_actor_answers_exactly_like_a_plain_manager() -> None:
    plain = KvManager(BlockPool(12), BS)
    plain_ids: dict[int, int] = {}
    actor_ids: dict[int, int] = {}
    async with open_manager(12, BS) as kv:
        for name, args in script(7):
            try:
                expected: Any = normalise(getattr(plain, name)(*args), plain_ids)
            except PoolError as exc:
                expected = type(exc)
            try:
                got: Any = normalise(await getattr(kv, name)(*args), actor_ids)
            except PoolError as exc:
                got = type(exc)
            assert got == expected, (name, args)
        await kv.check_invariants()
        assert await kv.stats() == plain.stats()


# ------------------------------------------------------------------ errors


@pytest.mark.anyio
async def test_misuse_through_the_actor_is_a_typed_error_and_the_actor_keeps_serving() -> None:
    async with open_manager(8, BS) as kv:
        await kv.add_request("a", list(range(6)))
        await kv.add_request("big", list(range(40)))
        assert await kv.allocate("a", 6) is not None
        before = (await kv.usage(), await kv.stats())
        with pytest.raises(DuplicateRequestError):
            await kv.add_request("a", [1])
        with pytest.raises(UnknownRequestError):
            await kv.free("nope")
        with pytest.raises(TokenCountError):
            await kv.allocate("a", 7)
        with pytest.raises(TokenCountError):
            await kv.mark_computed("a", 7)
        with pytest.raises(InvalidArgumentError):
            await kv.append_tokens("a", b"ab")
        with pytest.raises(InvalidArgumentError):
            await kv.add_request("b", [-1])
        # not a sequence of tokens: refused as the plain manager refuses it, never a
        # bare TypeError, and a set (no order) is not quietly turned into a prompt
        for not_tokens in (5, None, {1, 2}, (t for t in range(3))):
            with pytest.raises(InvalidArgumentError):
                await kv.add_request("b", not_tokens)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                await kv.append_tokens("a", not_tokens)  # type: ignore[arg-type]
        with pytest.raises(CapacityError):
            await kv.allocate("big", 40)
        assert (await kv.usage(), await kv.stats()) == before
        await kv.free("a")
        await kv.check_invariants()
        assert (await kv.usage()).num_active == 0


@pytest.mark.anyio
async def test_calls_after_the_block_raise_manager_closed() -> None:
    async with open_manager(4, BS) as kv:
        pass
    with pytest.raises(ManagerClosedError):
        await kv.add_request("a", [1])


# ------------------------------------------------------------------ waiting


@pytest.mark.anyio
async def test_new_tokens_ride_on_an_allocation_but_not_on_a_waiting_one() -> None:
    """The tokens an allocation carries are appended in its turn; a waiting allocation
    (retried until it fits) refuses them with a typed error and changes nothing."""
    async with open_manager(4, BS) as kv:
        await kv.add_request("a", list(range(6)))
        assert await kv.allocate("a", 6) is not None
        before = await kv.usage()
        with pytest.raises(InvalidArgumentError, match="waiting"):
            await kv.allocate("a", 8, wait=True, new_tokens=[6, 7])
        assert await kv.usage() == before
        with pytest.raises(TokenCountError):  # the refused call appended nothing
            await kv.allocate("a", 7)
        allocation = await kv.allocate("a", 8, cache=True, new_tokens=[6, 7])
        assert allocation is not None
        assert len(allocation.block_ids) == 0  # 8 tokens fit the 2 blocks it holds
        events = await kv.take_events()
        assert [len(e.block_hashes) for e in events] == [2]  # both blocks now full


@pytest.mark.anyio
async def test_a_waiting_allocation_is_granted_when_a_free_makes_room() -> None:
    async with open_manager(4, BS) as kv, anyio.create_task_group() as tg:
        await kv.add_request("a", list(range(16)))
        await kv.add_request("b", [9] * 8)
        assert await kv.allocate("a", 16) is not None
        assert await kv.allocate("b", 8) is None
        granted: list[Any] = []

        async def wait_for_room() -> None:
            granted.append(await kv.allocate("b", 8, wait=True))

        tg.start_soon(wait_for_room)
        await anyio.wait_all_tasks_blocked()
        assert granted == []
        await kv.free("a")
        await anyio.wait_all_tasks_blocked()
        assert len(granted) == 1
        assert granted[0] is not None
        assert len(granted[0].block_ids) == 2


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    async with open_manager(4, BS) as kv:
        await kv.add_request("a", list(range(16)))
        await kv.add_request("b", [9] * 8)
        assert await kv.allocate("a", 16) is not None
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(kv.allocate, "b", 8, wait=True))
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        await kv.free("a")
        await kv.check_invariants()
        assert (await kv.usage()).num_active == 0
        assert (await kv.prefill_cost("b")).new_blocks == 2


@pytest.mark.slow
@pytest.mark.anyio
async def test_waiters_are_granted_in_fifo_order_and_a_freed_waiter_gets_a_typed_error() -> None:
    async with open_manager(4, BS) as kv, anyio.create_task_group() as tg:
        await kv.add_request("hog", list(range(16)))
        assert await kv.allocate("hog", 16) is not None
        outcomes: dict[str, Any] = {}

        async def wait(rid: str) -> None:
            try:
                outcomes[rid] = await kv.allocate(rid, 8, wait=True)
            except UnknownRequestError as exc:
                outcomes[rid] = exc

        for rid in ("first", "gone", "second"):
            await kv.add_request(rid, [ord(rid[0])] * 8)
            tg.start_soon(wait, rid)
            await anyio.wait_all_tasks_blocked()
        await kv.free("gone")  # while "first" blocks the head of the FIFO, nobody moves
        await anyio.wait_all_tasks_blocked()
        assert outcomes == {}
        await kv.free("hog")  # room for both
        await anyio.wait_all_tasks_blocked()
        assert isinstance(outcomes["gone"], UnknownRequestError)
        first, second = outcomes["first"].block_ids, outcomes["second"].block_ids
        # Block ids carry a process-wide serial: "first" was granted before "second"
        # (tasks may wake in any order; trio shuffles them on purpose).
        assert len(first) == len(second) == 2
        assert max(first) < min(second)


# ------------------------------------------------------------ cancellation


class Worker:
    """One request's life with randomly cancelled calls; it remembers what it got."""

    def __init__(
        self,
        kv: ManagerClient,
        rid: str,
        prompt: list[int],
        rng: random.Random,
        drained: list[KVEvent],
    ) -> None:
        self.kv = kv
        self.drained = drained  # the events admissions drained, shared, in reply order
        self.rid = rid
        self.prompt = prompt
        self.rng = rng
        self.registered = False
        self.blocks: list[int] = []
        self.computed = 0

    async def cancelled_after(self, scope: anyio.CancelScope, turns: int) -> None:
        for _ in range(turns):
            await anyio.lowlevel.checkpoint()
        scope.cancel()

    async def run(self) -> None:
        kv, rng = self.kv, self.rng
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                tg.start_soon(self.cancelled_after, scope, rng.randrange(4))
                if rng.random() < 0.5:
                    await kv.add_request(self.rid, self.prompt)
                else:  # registered, asked and maybe admitted (a chunk) in one call
                    gate = AdmissionGate(rng.randrange(1, 12), rng.randrange(8))
                    queue = [QueuedRequest(self.rid, self.prompt)]
                    outcome = await kv.schedule([], queue, gate)
                    self.drained.extend(outcome.step.events)
                    if outcome.costs:
                        (allocation,) = outcome.step.allocations
                        self.blocks = allocation.block_ids
                        cached = allocation.cached_blocks * BS
                        self.computed = cached + min(len(self.prompt) - cached, gate.budget)
                self.registered = True
            if not self.registered:
                return
            for target in sorted({rng.randrange(1, len(self.prompt) + 1) for _ in range(3)}):
                with anyio.CancelScope() as scope:
                    tg.start_soon(self.cancelled_after, scope, rng.randrange(6))
                    allocation = await kv.allocate(self.rid, target, wait=rng.random() < 0.5)
                    if allocation is not None:
                        if not self.blocks:
                            self.computed = allocation.cached_blocks * BS
                        self.blocks += allocation.block_ids
                if len(self.blocks) * BS >= target > self.computed:
                    await kv.mark_computed(self.rid, target)  # never cancelled
                    self.computed = target


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [1, 2])
async def test_random_cancellation_is_all_or_nothing(seed: int) -> None:
    from router_view import RouterView

    rng = random.Random(seed)
    managers: list[KvManager] = []
    families = [[rng.randrange(20) for _ in range(rng.randrange(4, 16))] for _ in range(3)]
    drained: list[KVEvent] = []
    async with open_manager(40, BS, on_create=managers.append) as kv:
        workers = [
            Worker(
                kv,
                f"r{i}",
                rng.choice(families) + [rng.randrange(20)] * rng.randrange(9),
                rng,
                drained,
            )
            for i in range(150)
        ]
        async with anyio.create_task_group() as tg:
            for worker in workers:
                tg.start_soon(worker.run)
        await kv.check_invariants()  # runs after every pending undo
        (manager,) = managers
        for worker in workers:
            assert (worker.rid in manager) == worker.registered
            if worker.registered:
                assert manager.block_table(worker.rid) == worker.blocks
                assert manager.num_computed_tokens(worker.rid) == worker.computed

        # The events that left the actor form a consistent router view.
        view = RouterView(BS)
        view.apply(decode_batch(encode_batch(KVEventBatch(0.5, drained, None))))
        batch = await kv.take_batch(ts=1.0)
        if batch is not None:
            view.apply(decode_batch(encode_batch(batch)))
        hashes = {h for w in workers if w.registered for h in manager.block_hashes(w.rid)}
        resident = {h for h in hashes if manager.pool.prefix_hit(h) is not None}
        assert set(view.parents) == resident

        for worker in workers:
            if worker.registered:
                await kv.free(worker.rid)
        usage = await kv.usage()
        assert usage.num_active == 0
        assert manager.pool.num_active_refs() == 0
        await kv.check_invariants()


# ------------------------------------------------------- the undo handlers


def _handlers() -> tuple[ManagerState, KvManager]:
    manager = KvManager(BlockPool(8), BS)
    return ManagerState(manager), manager


def test_undoing_an_unread_allocation_gives_the_blocks_back() -> None:
    handlers, manager = _handlers()
    manager.add_request("a", list(range(9)))
    message = AllocateSlots("a", 9)
    reply = handlers.allocate(message)
    assert manager.pool.num_active() == 3
    handlers.undo_allocate(message, reply)  # type: ignore[arg-type]
    assert manager.pool.num_active() == 0
    assert manager.num_blocks("a") == 0
    manager.check_invariants()


def test_undoing_unread_step_allocations_give_back_their_blocks_and_their_events() -> None:
    """An `AllocateSteps` whose caller never read the reply: every step's blocks go back
    and the events they drained (an older one included) are queued again, oldest first."""
    handlers, manager = _handlers()
    manager.add_request("old", list(range(100, 104)))
    assert manager.allocate("old", 4, cache=True) is not None  # one Stored queued
    manager.add_request("a", list(range(9)))
    manager.add_request("b", list(range(50, 55)))
    message = AllocateSteps(
        [[SlotRequest("a", 9), SlotRequest("b", 5)], [SlotRequest("a", 13, [1, 2, 3, 4])]]
    )
    reply = handlers.allocate_steps(message)
    first, second = reply.steps
    assert [len(allocation.block_ids) for allocation in first.allocations] == [3, 2]
    assert [len(e.block_hashes) for e in first.events] == [1, 2, 1]  # old's, a's, b's
    assert [len(allocation.block_ids) for allocation in second.allocations] == [1]
    assert [len(e.block_hashes) for e in second.events] == [1]  # a's third block filled
    assert manager.num_pending_events == 0
    handlers.undo_allocate_steps(message, reply)
    assert (manager.num_blocks("a"), manager.num_blocks("b")) == (0, 0)
    assert manager.pool.num_active() == 1  # old's block only
    assert manager.take_events() == first.events + second.events
    manager.check_invariants()


def test_undoing_an_unread_stretch_gives_back_its_blocks_and_its_events() -> None:
    """An `AllocateStretch` whose caller never read the reply: as `AllocateSteps`', its
    blocks go back, last first, and the events it drained are queued again."""
    handlers, manager = _handlers()
    manager.add_request("old", list(range(100, 104)))
    assert manager.allocate("old", 4, cache=True) is not None  # one Stored queued
    manager.add_request("a", list(range(3)))
    assert manager.allocate("a", 3, cache=True) is not None
    before = manager.pool.num_active()
    # a's first block fills (Stored), then its table grows by one block
    message = AllocateStretch(DecodeStretch(["a"], [[7, 8]], [0, 0], [4, 5], [1, 1], [1, 2]))
    reply = handlers.allocate_stretch(message)
    assert [len(allocation.block_ids) for allocation in reply.allocations] == [0, 1]
    assert [step for step, _ in reply.events] == [0]
    assert manager.num_pending_events == 0
    handlers.undo_allocate_stretch(message, reply)
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before
    assert manager.take_events() == reply.events[0][1]
    manager.check_invariants()


def test_undoing_an_unread_finish_stretch_keeps_its_frees() -> None:
    """A `FinishStretch` whose caller never read the reply: its frees stay made (it
    gives blocks back), the survivors' allocations go back as an unread stretch's do,
    and the events it drained are queued again, the stretch's first."""
    handlers, manager = _handlers()
    for name, first in (("a", 0), ("b", 10)):
        manager.add_request(name, list(range(first, first + 3)))
        assert manager.allocate(name, 3, cache=True) is not None
    manager.take_events()
    before = manager.pool.num_active()
    # a's first block fills (Stored), then its table grows; b finishes
    stretch = DecodeStretch(["a"], [[7, 8]], [0, 0], [4, 5], [1, 1], [1, 2])
    message = FinishStretch(stretch, [StepUpdate("b", [], -1, True)])
    reply = handlers.finish_stretch(message)
    assert [len(allocation.block_ids) for allocation in reply.allocations.allocations] == [0, 1]
    assert "b" not in manager
    handlers.undo_finish_stretch(message, reply)
    assert "b" not in manager  # freed for good
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before - 1  # b's block went idle
    drained = [event for _, events in reply.allocations.events for event in events]
    assert manager.take_events() == drained + reply.outcome.events
    manager.check_invariants()


def test_undoing_an_unread_run_gives_back_its_blocks_and_its_events() -> None:
    """An `AllocateRun` whose caller never read the reply: as an `AllocateStretch`'s,
    its blocks go back and the events it drained are queued again."""
    handlers, manager = _handlers()
    manager.add_request("old", list(range(100, 104)))
    assert manager.allocate("old", 4, cache=True) is not None  # one Stored queued
    manager.add_request("a", list(range(3)))
    assert manager.allocate("a", 3, cache=True) is not None
    before = manager.pool.num_active()
    # a's first block fills at step 0 (Stored), its table grows at step 1
    message = AllocateRun(DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2))
    reply = handlers.allocate_run(message)
    assert [len(allocation.block_ids) for allocation in reply.allocations] == [1]
    assert (reply.slots, [step for step, _ in reply.events]) == (2, [0])
    assert manager.num_pending_events == 0
    handlers.undo_allocate_run(message, reply)
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before
    assert manager.take_events() == reply.events[0][1]
    manager.check_invariants()


def test_undoing_an_unread_finish_run_keeps_its_frees() -> None:
    """A `FinishRun` whose caller never read the reply: its frees stay made, the
    survivors' allocations go back, and the drained events are queued again."""
    handlers, manager = _handlers()
    for name, first in (("a", 0), ("b", 10)):
        manager.add_request(name, list(range(first, first + 3)))
        assert manager.allocate(name, 3, cache=True) is not None
    manager.take_events()
    before = manager.pool.num_active()
    message = FinishRun(
        DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2), [StepUpdate("b", [], -1, True)]
    )
    reply = handlers.finish_run(message)
    assert [len(allocation.block_ids) for allocation in reply.allocations.allocations] == [1]
    assert "b" not in manager
    handlers.undo_finish_run(message, reply)
    assert "b" not in manager  # freed for good
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before - 1  # b's block went idle
    drained = [event for _, events in reply.allocations.events for event in events]
    assert manager.take_events() == drained + reply.outcome.events
    manager.check_invariants()


def test_undoing_an_unread_finish_chain_keeps_its_frees_and_queues_its_events_in_order() -> None:
    """A `FinishChain` whose caller never read the reply: its frees stay made, the
    survivors' allocations go back, and every event it drained is queued again in the
    order it was queued: the first leave's (an older event, drained by its frees, its
    segment having no slot) before the next segment's steps', those before the second
    leave's, then the last segment's."""
    managers = []
    for _ in range(2):
        handlers, manager = _handlers()
        manager.add_request("old", list(range(100, 104)))
        assert manager.allocate("old", 4, cache=True) is not None  # one Stored queued
        for name, first in (("a", 0), ("b", 10)):
            manager.add_request(name, list(range(first, first + 3)))
            assert manager.allocate(name, 3, cache=True) is not None
        managers.append((handlers, manager))
    (handlers, manager), (_, twin) = managers
    before = manager.pool.num_active()
    # a and b fill their first blocks at step 1 (Stored), b leaving then; a grows at
    # step 2 and fills that block at step 5 (Stored); "old" leaves after step 0
    run = DecodeRun(["a", "b"], [[7, 8, 9, 10, 11], [20]], [3, 3], [2, -1], [1, 1], 6)
    chain = DecodeChain(run, [0, 1], [["old"], ["b"]])
    message = FinishChain(chain)
    reply = handlers.finish_chain(message)
    assert [allocation.num_blocks for allocation in reply.run.allocations] == [1, 0]
    assert (reply.run.slots, reply.groups) == (4, [0, 1])
    assert [len(outcome.events) for outcome in reply.outcomes] == [1, 0]
    assert manager.num_pending_events == 0
    handlers.undo_finish_chain(message, reply)
    assert "old" not in manager  # freed for good
    assert "b" not in manager
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before - 2  # old's and b's blocks went idle
    # the same calls one by one on a twin, each one's events as it drained them
    queued: list[KVEvent] = []
    for piece, updates in chain.segments(BS):
        if piece is not None:
            result = twin.allocate_run(piece)
            queued += [event for _, events in result.events for event in events]
        if updates:
            queued += twin.finish_step(updates).events
    assert [type(event).__name__ for event in queued] == ["BlockStored"] * 4
    assert queued[:1] == reply.outcomes[0].events  # old's, drained by the first leave
    assert manager.take_events() == queued
    manager.check_invariants()


def _two_decoding() -> tuple[ManagerState, KvManager, DecodeChain]:
    """Handlers over a manager with ``a`` (3 tokens) and ``b`` (3 tokens, two blocks'
    worth with its chain) decoding, and a chain in which ``a`` fills its first block at
    step 0 and grows at step 1 while ``b`` leaves after step 0."""
    handlers, manager = _handlers()
    for name, first in (("a", 0), ("b", 10)):
        manager.add_request(name, list(range(first, first + 3)))
        assert manager.allocate(name, 3, cache=True) is not None
    manager.take_events()
    chain = DecodeChain(DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2), [0], [["b"]])
    return handlers, manager, chain


def test_undoing_an_unread_schedule_after_chain_keeps_its_frees() -> None:
    """A `ScheduleAfterChain` whose caller never read the reply: the request it admitted
    is forgotten, the chain's growth goes back, its free stays made, and the events are
    queued again in the order they were drained."""
    handlers, manager, chain = _two_decoding()
    before = manager.pool.num_active()
    queue = [QueuedRequest("c", list(range(20, 29)))]
    message = ScheduleAfterChain(chain, [], queue, AdmissionGate(16, 2))
    reply = handlers.schedule_after_chain(message)
    assert [allocation.num_blocks for allocation in reply.step.allocations] == [3]
    assert "b" not in manager
    handlers.undo_schedule_after_chain(message, reply)
    assert "c" not in manager
    assert "b" not in manager  # freed for good
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before - 1  # b's block went idle
    carried = reply.run
    assert isinstance(carried, ChainAllocations)
    drained = [event for _, events in carried.run.events for event in events]
    drained += [event for outcome in carried.outcomes for event in outcome.events]
    assert manager.take_events() == drained + reply.step.events
    manager.check_invariants()


async def _chain_to_admit(kv: ManagerClient) -> tuple[int, DecodeChain, list[QueuedRequest]]:
    """``a`` and ``b`` decoding in ``kv``'s manager; the active blocks then, a chain in
    which ``a`` fills its first block at step 0 and grows at step 1 while ``b`` leaves
    after step 0, and a queue of one new request ``c`` (three blocks)."""
    for name, first in (("a", 0), ("b", 10)):
        await kv.add_request(name, list(range(first, first + 3)))
        assert await kv.allocate(name, 3, cache=True) is not None
    before = (await kv.usage()).num_active
    chain = DecodeChain(DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2), [0], [["b"]])
    return before, chain, [QueuedRequest("c", list(range(20, 29)))]


@pytest.mark.asyncio
async def test_asyncio_schedule_after_chain_cancelled_after_the_reply_keeps_its_frees() -> None:
    """Its caller cancelled before it read the reply: the admission and the chain's
    growth are given back, the chain's free stays made (a give-back), and the pool
    holds what the free left it."""
    managers: list[KvManager] = []
    async with open_manager(16, 4, on_create=managers.append) as kv:
        (manager,) = managers
        before, chain, queue = await _chain_to_admit(kv)
        call = kv.schedule([], queue, AdmissionGate(16, 8), chain)
        await _cancel_after_reply(manager, call, lambda: "c" in manager)
        await kv.check_invariants()  # queued behind the undo
        assert "c" not in manager
        assert "b" not in manager
        assert manager.num_blocks("a") == 1
        assert (await kv.usage()).num_active == before - 1


@pytest.mark.anyio
async def test_a_schedule_after_chain_in_a_cancelled_scope_still_frees() -> None:
    """A give-back: made in a cancelled scope too (its frees cannot wait for a next
    call that would carry the chain again), and what it handed out given back."""
    managers: list[KvManager] = []
    async with open_manager(16, 4, on_create=managers.append) as kv:
        (manager,) = managers
        before, chain, queue = await _chain_to_admit(kv)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await kv.schedule([], queue, AdmissionGate(16, 8), chain)
        assert scope.cancelled_caught
        await kv.check_invariants()
        assert "b" not in manager
        assert "c" not in manager
        assert manager.num_blocks("a") == 1
        assert (await kv.usage()).num_active == before - 1


def test_undoing_an_unread_add_request_forgets_it() -> None:
    handlers, manager = _handlers()
    message = AddRequest("a", [1, 2])
    handlers.undo_add_request(message, handlers.add_request(message))
    assert "a" not in manager


def test_undoing_an_unread_schedule_gives_back_its_blocks_and_its_events() -> None:
    """A `ScheduleStep` whose caller never read the reply: its running slot's and its
    admissions' blocks go back, the request it registered is forgotten (one registered
    before stays, queued), and the events it drained (an older one included) are queued
    again, oldest first."""
    handlers, manager = _handlers()
    manager.add_request("old", list(range(100, 104)))
    assert manager.allocate("old", 4, cache=True) is not None  # one Stored queued
    manager.add_request("run", list(range(200, 203)))
    assert manager.allocate("run", 3, cache=True) is not None  # one block, none full
    manager.add_request("known", list(range(50, 54)))
    message = ScheduleStep(
        [SlotRequest("run", 5, [7, 8])],
        [QueuedRequest("new", list(range(9))), QueuedRequest("known")],
        AdmissionGate(16, 8, seats=2),
    )
    reply = handlers.schedule(message)
    assert [a.num_blocks for a in reply.step.allocations] == [1, 3, 1]
    assert [len(e.block_hashes) for e in reply.step.events] == [1, 1, 2, 1]
    handlers.undo_schedule(message, reply)
    assert "new" not in manager
    assert (manager.num_blocks("run"), manager.num_blocks("known")) == (1, 0)
    assert manager.pool.num_active() == 2  # old's block and run's first
    assert manager.take_events() == reply.step.events
    manager.check_invariants()


def test_undoing_an_unread_schedule_undoes_the_run_it_carried_too() -> None:
    """A `ScheduleStep` carrying a run, whose caller never read the reply: the step's
    admission goes back and is forgotten, then the run's growth, and every event either
    drained (the run's first, then the step's) is queued again in that order."""
    handlers, manager = _handlers()
    manager.add_request("a", list(range(3)))
    assert manager.allocate("a", 3, cache=True) is not None
    manager.take_events()
    before = manager.pool.num_active()
    # a's first block fills at step 0 (Stored), its table grows at step 1
    message = ScheduleStep(
        [],
        [QueuedRequest("new", list(range(20, 29)))],
        AdmissionGate(16, 8, seats=2),
        DecodeRun(["a"], [[7, 8]], [4], [1], [0], 2),
    )
    reply = handlers.schedule(message)
    assert reply.run is not None
    assert [len(allocation.block_ids) for allocation in reply.run.allocations] == [1]
    assert [a.num_blocks for a in reply.step.allocations] == [3]
    handlers.undo_schedule(message, reply)
    assert "new" not in manager
    assert manager.num_blocks("a") == 1
    assert manager.pool.num_active() == before
    drained = [event for _, events in reply.run.events for event in events]
    assert drained
    assert manager.take_events() == drained + reply.step.events
    manager.check_invariants()


def test_undoing_an_unread_drain_puts_the_events_back_in_order() -> None:
    handlers, manager = _handlers()
    manager.add_request("a", list(range(8)))
    assert manager.allocate("a", 8) is not None
    manager.mark_computed("a", 4)
    reply = handlers.take_events(TakeEvents())
    manager.mark_computed("a", 8)
    handlers.undo_take_events(TakeEvents(), reply)
    events = manager.take_events()
    assert len(events) == 2
    assert events[0] == reply.events[0]


# ------------------------------------- asyncio: cancelled after the actor replied


async def _cancel_after_reply(manager: KvManager, call: Any, replied: Any) -> None:
    """Start ``call``, wait until the actor has handled it, then cancel the caller before
    it reads the reply (possible on asyncio only: a plain ``task.cancel()`` lands on a
    task whose awaited future is already done, while trio always delivers a sent
    reply). Every call is a checkpoint, so the window always exists."""
    task = asyncio.ensure_future(call)
    while not replied() and not task.done():
        await asyncio.sleep(0)
    assert not task.done(), "the caller read its reply before it could be cancelled"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_asyncio_allocation_cancelled_after_the_reply_is_undone() -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("a", list(range(9)))
        await _cancel_after_reply(manager, kv.allocate("a", 9), lambda: manager.num_blocks("a") > 0)
        await kv.check_invariants()  # queued behind the undo
        assert manager.num_blocks("a") == 0
        assert (await kv.usage()).num_active == 0
        allocation = await kv.allocate("a", 9)
        assert allocation is not None
        assert len(allocation.block_ids) == 3


@pytest.mark.asyncio
async def test_asyncio_drain_cancelled_after_the_reply_loses_no_event() -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("a", list(range(8)))
        assert await kv.allocate("a", 8) is not None
        await kv.mark_computed("a", 4)
        await _cancel_after_reply(
            manager, kv.take_events(), lambda: manager.num_pending_events == 0
        )
        await kv.mark_computed("a", 8)
        events = await kv.take_events()
        assert [e.block_hashes for e in events] == [[h] for h in manager.block_hashes("a")]


@pytest.mark.asyncio
async def test_asyncio_schedule_cancelled_after_the_reply_is_undone() -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        queue = [QueuedRequest("a", list(range(9)))]
        call = kv.schedule([], queue, AdmissionGate(16, 8))
        await _cancel_after_reply(manager, call, lambda: "a" in manager)
        await kv.check_invariants()  # queued behind the undo
        assert "a" not in manager
        assert (await kv.usage()).num_active == 0
        outcome = await kv.schedule([], queue, AdmissionGate(16, 8))  # not a duplicate
        assert [a.num_blocks for a in outcome.step.allocations] == [3]


@pytest.mark.asyncio
async def test_asyncio_add_request_cancelled_after_the_reply_is_forgotten() -> None:
    managers: list[KvManager] = []
    async with open_manager(8, BS, on_create=managers.append) as kv:
        (manager,) = managers
        await _cancel_after_reply(manager, kv.add_request("a", [1, 2]), lambda: "a" in manager)
        await kv.check_invariants()
        assert "a" not in manager
        await kv.add_request("a", [1, 2])  # not a duplicate


@pytest.mark.asyncio
async def test_asyncio_schedule_carrying_a_run_cancelled_after_the_reply_is_undone() -> None:
    """A `ScheduleStep` that carried a jump's run, its caller cancelled before it read the
    reply: the admission is forgotten and the run's growth given back, so the pool holds
    what it held before the call; the same step then goes through again."""
    managers: list[KvManager] = []
    async with open_manager(16, 4, on_create=managers.append) as kv:
        (manager,) = managers
        await kv.add_request("r", list(range(3)))
        assert await kv.allocate("r", 3, cache=True) is not None
        before = (await kv.usage()).num_active
        run = DecodeRun(["r"], [[7, 8]], [4], [1], [0], 2)  # grows at step 1
        queue = [QueuedRequest("a", list(range(20, 29)))]
        call = kv.schedule([], queue, AdmissionGate(16, 8), run)
        await _cancel_after_reply(manager, call, lambda: "a" in manager)
        await kv.check_invariants()  # queued behind the undo
        assert "a" not in manager
        assert manager.num_blocks("r") == 1
        assert (await kv.usage()).num_active == before
