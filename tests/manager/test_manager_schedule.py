"""`KvManager.schedule`: a step's running slots, then vLLM's waiting loop (registration,
cost, admission check, first allocation), in one call, equal to the calls it stands for."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, same_state, snapshot, twin_tables
from test_manager_stretch import MODES

from kvpool.errors import (
    CapacityError,
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
