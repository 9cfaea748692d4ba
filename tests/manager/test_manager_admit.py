"""`KvManager.admit`: a queued request's registration, cost, admission check and first
allocation in one call, equal to the calls it stands for."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, make, same_state, snapshot, twin_tables
from test_manager_stretch import MODES

from kvpool.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    PoolError,
    UnknownRequestError,
)
from kvpool.manager import AdmissionGate, KvManager, PrefillCost, SlotRequest

ADMIT_MODES = {**MODES, "no caching": {"enable_prefix_caching": False}}


def gates() -> st.SearchStrategy[AdmissionGate]:
    return st.builds(
        AdmissionGate,
        budget=st.integers(1, 20),
        headroom=st.integers(-2, 14),
        chunked=st.booleans(),
        full_sequence=st.booleans(),
    )


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(sorted(ADMIT_MODES)))
def test_admit_is_the_calls_it_stands_for(data: st.DataObject, mode: str) -> None:
    """On twin managers: ``admit`` equals `add_request` (a new request) or
    `prefill_cost`, the gate at that cost, and, if it lets the request in,
    `allocate_steps` of its one slot with the probe; same outcome, same state after."""
    _, one, two, names = twin_tables(data, 5, frees=True, **ADMIT_MODES[mode])
    queued = [name for name in names if not one.num_blocks(name)]
    new = data.draw(st.booleans(), label="new") or not queued
    if new:
        name = "new"
        prompt: list[int] | None = data.draw(
            st.lists(st.integers(0, 3), min_size=1, max_size=16), label="prompt"
        )
    else:
        name = data.draw(st.sampled_from(queued), label="queued")
        prompt = None
    others = [other for other in names if other != name]
    probe = data.draw(st.none() | st.sampled_from(others), label="probe") if others else None
    gate = data.draw(gates(), label="gate")
    pending = two.take_events()  # what the call drains, on the plain side
    assert one.take_events() == pending

    before = snapshot(one)
    try:
        outcome = one.admit(name, prompt, gate, probe)
    except CapacityError:
        outcome = None
        assert snapshot(one) == before

    cost = two.add_request(name, prompt) if prompt is not None else two.prefill_cost(name)
    admission = gate.admit(cost, two.num_tokens(name), BS)
    if outcome is None:  # the allocation could never fit: it raises
        assert admission is not None
        with pytest.raises(CapacityError):
            two.allocate_steps([[SlotRequest(name, admission[0] + admission[1])]], probe)
        event(f"{mode}: never fits")
        return
    assert outcome.cost == cost
    allocation = None
    if admission is not None:
        (step,) = two.allocate_steps([[SlotRequest(name, admission[0] + admission[1])]], probe)
        if step.allocations:
            (allocation,) = step.allocations
            assert outcome.step.cost == step.cost
        assert outcome.step.events == step.events
    else:
        assert outcome.step.events == two.take_events()
    admitted = outcome.allocation
    assert (admitted is None) == (allocation is None)
    if admitted is not None and allocation is not None:  # the pools name blocks apart
        assert admitted.num_blocks == allocation.num_blocks
        assert admitted.cached_blocks == allocation.cached_blocks
        assert admitted.removed_runs == allocation.removed_runs
    assert outcome.step.stats == two.stats()
    assert same_state(one, two)
    event(f"{mode}: {'admitted' if allocation else 'refused'}")


def test_a_refused_admission_registers_and_allocates_nothing() -> None:
    """The gate refuses: the new request is registered with its cost, nothing else."""
    manager = make(capacity=4)
    outcome = manager.admit("a", list(range(9)), AdmissionGate(budget=16, headroom=2))
    assert outcome.cost == PrefillCost(0, 0, 3)
    assert outcome.allocation is None  # 3 fresh blocks, 2 allowed
    assert "a" in manager
    assert manager.num_blocks("a") == 0
    assert manager.pool.num_active() == 0
    # the same request, asked again with room, is admitted (no prompt: registered)
    outcome = manager.admit("a", None, AdmissionGate(budget=16, headroom=3))
    assert outcome.allocation is not None
    assert outcome.allocation.num_blocks == 3
    assert manager.num_computed_tokens("a") == 9


def test_an_admission_reuses_the_cached_prefix_and_takes_a_chunk_of_the_budget() -> None:
    """The cost counts the cached prefix; a chunked admission takes the budget's tokens,
    and without the full-sequence gate only that chunk's blocks must fit."""
    manager = make(capacity=8)
    manager.add_request("a", list(range(12)))
    assert manager.allocate("a", 12, cache=True) is not None  # 3 blocks cached
    prompt = list(range(8)) + list(range(100, 120))  # 2 cached blocks, then 20 tokens
    gate = AdmissionGate(budget=5, headroom=2, chunked=True, full_sequence=False)
    outcome = manager.admit("b", prompt, gate, probe="a")
    assert outcome.cost == PrefillCost(2, 2, 5)
    assert outcome.allocation is not None
    assert (outcome.allocation.cached_blocks, outcome.allocation.num_blocks) == (2, 4)
    assert manager.num_computed_tokens("b") == 13  # 8 cached + the 5-token chunk
    assert outcome.step.cost == PrefillCost(0, 0, 0)  # the probe, after it
    # the whole sequence's 5 fresh blocks would not have fit in 2
    refused = make(capacity=8)
    refused.add_request("a", list(range(12)))
    assert refused.allocate("a", 12, cache=True) is not None
    strict = AdmissionGate(budget=5, headroom=2, chunked=True, full_sequence=True)
    assert refused.admit("b", prompt, strict).allocation is None


def queued_manager() -> KvManager:
    manager = make(capacity=4)
    manager.add_request("a", [1, 2, 3])
    manager.add_request("held", list(range(6)))
    assert manager.allocate("held", 6, cache=True) is not None
    return manager


GATE = AdmissionGate(budget=16, headroom=4)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("a", [1], GATE), DuplicateRequestError),  # registered already
        (("b", None, GATE), UnknownRequestError),  # unknown, and no prompt to register
        (("held", None, GATE), InvalidArgumentError),  # holds blocks: not queued
        (("b", [1, -1], GATE), InvalidArgumentError),  # a token outside u32
        ((3, [1], GATE), InvalidArgumentError),  # not a str id
        (("b", [1], (16, 4)), InvalidArgumentError),  # not a gate
        (("b", [1], AdmissionGate(0, 4)), InvalidArgumentError),  # no budget
        (("b", [1], AdmissionGate(16, 4.0)), InvalidArgumentError),  # type: ignore[arg-type]
        (("b", [1], AdmissionGate(16, 4, chunked=1)), InvalidArgumentError),  # type: ignore[arg-type]
        (("b", [1], GATE, "nobody"), UnknownRequestError),  # unknown probe
        (("a", None, GATE, "a"), InvalidArgumentError),  # probes itself
        (("b", list(range(30)), AdmissionGate(32, 99)), CapacityError),  # 8 blocks, 4 in all
    ],
)
def test_a_bad_admission_raises_and_changes_nothing(
    args: tuple[Any, ...], error: type[PoolError]
) -> None:
    manager = queued_manager()
    before = snapshot(manager)
    requests = sorted(manager)
    with pytest.raises(error):
        manager.admit(*args)
    assert snapshot(manager) == before
    assert sorted(manager) == requests
