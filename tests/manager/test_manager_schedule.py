"""`KvManager.schedule`: a step's running slots, then vLLM's waiting loop (registration,
cost, admission check, first allocation), in one call, equal to the calls it stands for."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, evict_order, same_state, snapshot, twin_tables
from test_manager_run import decoding, summary
from test_manager_stretch import MODES

from kvpool.errors import (
    CapacityError,
    InvalidArgumentError,
    TokenCountError,
)
from kvpool.manager import (
    AdmissionGate,
    KvManager,
    PrefillCost,
    QueuedRequest,
    SlotRequest,
    StepAllocations,
)
from kvpool.manager.admission import admit_blocks

SCHEDULE_MODES = {**MODES, "no caching": {"enable_prefix_caching": False}}


def gates(free: int) -> st.SearchStrategy[AdmissionGate]:
    """Mostly open gates (a closed one, no budget or no seat, now and then), whose
    headroom is about the ``free`` blocks (a scheduler's is what is free or evictable)."""
    return st.builds(
        AdmissionGate,
        budget=st.integers(-2, 24).map(lambda n: max(n, 0)),
        headroom=st.integers(free - 3, free + 1),
        watermark=st.integers(0, 2),
        running=st.integers(0, 2),
        seats=st.integers(-1, 4).map(lambda n: max(n, 0)),
        chunked=st.booleans(),
        full_sequence=st.booleans(),
    )


def some(names: list[str]) -> st.SearchStrategy[list[str]]:
    """Some of ``names``, each at most once, in any order."""
    return st.lists(st.sampled_from(names), unique=True) if names else st.just([])


def plain_schedule(
    manager: KvManager,
    slots: list[SlotRequest],
    queue: list[QueuedRequest],
    gate: AdmissionGate,
) -> tuple[list[StepAllocations], list[PrefillCost], PrefillCost | None]:
    """What `schedule` stands for, call by call: the slots' `allocate_steps`, then for
    each queued request while budget and a seat are left: `add_request` (a prompt) or
    `prefill_cost`, the gate (`AdmissionGate.admit`), and `allocate_steps` of its slot;
    the gate moves on by hand. Returns the steps, the admitted costs and the cost of the
    first request not admitted that the manager knows."""
    active = manager.pool.num_active()
    steps = [manager.allocate_steps([slots])[0]] if slots else []
    if steps and len(steps[0].allocations) < len(slots):
        return steps, [], None
    budget, running, seats = gate.budget, gate.running, gate.seats
    headroom = gate.headroom - (manager.pool.num_active() - active)
    costs: list[PrefillCost] = []
    for queued in queue:
        rid = queued.request_id
        if budget <= 0 or seats <= 0:  # closed: a new request is not even registered
            known = queued.prompt_token_ids is None
            return steps, costs, manager.prefill_cost(rid) if known else None
        if queued.prompt_token_ids is not None:
            cost = manager.add_request(rid, queued.prompt_token_ids)
        else:
            cost = manager.prefill_cost(rid)
        admission = admit_blocks(
            cost.cached_blocks,
            cost.active_cached_blocks,
            manager.num_tokens(rid),
            BS,
            budget,
            headroom,
            gate.watermark,
            running,
            gate.chunked,
            gate.full_sequence,
        )
        if admission is None:
            return steps, costs, cost
        (step,) = manager.allocate_steps([[SlotRequest(rid, admission[0] + admission[1])]])
        steps.append(step)
        if not step.allocations:
            return steps, costs, cost
        costs.append(cost)
        budget -= admission[1]
        headroom -= admission[2] + admission[3]
        running += 1
        seats -= 1
    return steps, costs, None


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(sorted(SCHEDULE_MODES)))
def test_schedule_is_the_calls_it_stands_for(data: st.DataObject, mode: str) -> None:
    """On twin managers: ``schedule`` equals its slots' `allocate_steps`, then, one
    queued request after another, `add_request` or `prefill_cost`, the gate, and the
    allocation; same outcome, same state after (an error changes nothing)."""
    capacity, one, two, names = twin_tables(data, 5, frees=True, **SCHEDULE_MODES[mode])
    holders = [name for name in names if one.num_blocks(name)]
    slots = []
    # a slot past the pool would be another error (`allocate_steps`' own)
    growable = [name for name in holders if one.num_tokens(name) <= capacity * BS]
    for name in data.draw(some(growable), label="slots"):
        room = capacity * BS - one.num_tokens(name)
        more = data.draw(st.integers(0, min(6, room)), label=f"{name} grows by")
        slots.append(SlotRequest(name, one.num_tokens(name) + more, [1] * more))
    queue = [
        QueuedRequest(name)
        for name in data.draw(some([n for n in names if n not in holders]), label="queued")
    ]
    for k in range(data.draw(st.integers(1, 2), label="new")):
        prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=16), label=f"n{k}")
        at = data.draw(st.integers(0, len(queue)), label=f"n{k} at")
        queue.insert(at, QueuedRequest(f"n{k}", prompt))
    gate = data.draw(gates(one.pool.capacity - one.pool.num_active()), label="gate")
    assert one.take_events() == two.take_events()  # the call drains: start empty

    before = snapshot(one)
    try:
        outcome = one.schedule(slots, queue, gate)
    except CapacityError:
        assert snapshot(one) == before
        lengths = [
            len(q.prompt_token_ids)
            if q.prompt_token_ids is not None
            else one.num_tokens(q.request_id)
            for q in queue
        ]
        assert any(-(-length // BS) > one.pool.capacity for length in lengths)
        event(f"{mode}: never fits")
        return

    steps, costs, asked = plain_schedule(two, slots, queue, gate)
    assert outcome.costs == costs
    assert outcome.step.cost == asked
    mine = outcome.step.allocations
    theirs = [allocation for step in steps for allocation in step.allocations]
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):  # the pools name blocks apart
        assert (a.num_blocks, a.cached_blocks, a.removed_runs) == (
            b.num_blocks,
            b.cached_blocks,
            b.removed_runs,
        )
    assert outcome.step.events == [event for step in steps for event in step.events]
    assert outcome.step.stats == two.stats()
    assert sorted(one) == sorted(two)
    assert same_state(one, two)
    event(f"{mode}: {len(costs)} admitted")


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_a_carried_run_is_allocate_run_then_schedule(data: st.DataObject, mode: str) -> None:
    """``schedule(..., run)`` on one twin, `allocate_run` of the run then `schedule` on
    the other: the same run result, the same step, the same state after. A run that
    does not fit whole, or a step whose slot asks for more tokens than the run leaves
    its request, raises and changes nothing: the run is checked with the step, before
    either is made."""
    one, two, run, _ = decoding(data, **MODES[mode])
    if not run.request_ids:
        return
    # a slot per chosen request of the run, up to the tokens the run leaves it with
    chosen = data.draw(some(run.request_ids), label="slots")
    over = data.draw(st.booleans(), label="one slot too many tokens") and bool(chosen)
    slots = []
    for k, name in enumerate(chosen):
        held = two.num_tokens(name) + len(run.new_tokens[run.request_ids.index(name)])
        slots.append(SlotRequest(name, held + (1 if over and k == 0 else 0)))
    queue = [QueuedRequest("new", data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=9)))]
    gate = data.draw(gates(one.pool.capacity - one.pool.num_active()), label="gate")
    assert one.take_events() == two.take_events()
    before = snapshot(one)
    ran = two.allocate_run(run)
    if ran.slots < len(run.stretch(BS).members):
        with pytest.raises(InvalidArgumentError, match="fit whole"):
            one.schedule(slots, queue, gate, run)
        assert snapshot(one) == before
        event(f"{mode}: a run that does not fit whole")
        return
    if over:
        with pytest.raises(TokenCountError):
            one.schedule(slots, queue, gate, run)
        assert snapshot(one) == before
        event(f"{mode}: a slot past its tokens")
        return
    got = one.schedule(slots, queue, gate, run)
    expected = two.schedule(slots, queue, gate)
    assert got.run is not None
    assert summary(got.run) == summary(ran)
    assert got.costs == expected.costs
    assert got.step.cost == expected.step.cost
    assert [len(a.block_ids) for a in got.step.allocations] == [
        len(a.block_ids) for a in expected.step.allocations
    ]
    assert got.step.events == expected.step.events
    assert got.step.stats == expected.step.stats
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)
    event(f"{mode}: {len(got.costs)} admitted")
