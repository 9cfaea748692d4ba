"""`KvManager.allocate_stretch`: the compact form of a run of decode steps' allocations
is `allocate_steps` of the steps it stands for (`DecodeStretch.steps`), result for result
(`StretchAllocations.of_steps`) and state for state, and a bad stretch is a typed error
that changes nothing; `KvManager.finish_stretch` is the stretch then `finish_step`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import (
    BS,
    evict_order,
    make,
    same_state,
    snapshot,
    twin_requests,
    twin_tables,
)

from kvpool.errors import (
    CapacityError,
    InvalidArgumentError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.manager import (
    DecodeStretch,
    KvManager,
    PrefillCost,
    SlotRequest,
    StepUpdate,
    StretchAllocations,
)


def drawn_stretch(
    data: st.DataObject, capacity: int, manager: KvManager, names: list[str]
) -> DecodeStretch:
    """A random stretch over the requests of ``names`` that hold blocks: random steps,
    each naming some of them once with random generated tokens and a target between
    the computed count and the tokens held (the pool's capacity at most)."""
    holders = [name for name in names if manager.num_blocks(name)]
    request_ids = data.draw(st.permutations(holders), label="requests")
    tokens = {name: manager.num_tokens(name) for name in request_ids}
    computed = {name: manager.num_computed_tokens(name) for name in request_ids}
    new_tokens: list[list[int]] = [[] for _ in request_ids]
    members: list[int] = []
    targets: list[int] = []
    appends: list[int] = []
    step_ends: list[int] = []
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        chosen = (
            data.draw(st.lists(st.sampled_from(range(len(request_ids))), unique=True))
            if request_ids
            else []
        )
        for member in chosen:
            name = request_ids[member]
            new = data.draw(st.lists(st.integers(0, 3), max_size=5), label=f"{name} new")
            most = min(tokens[name] + len(new), capacity * BS)
            if most < computed[name]:
                continue
            target = data.draw(st.integers(computed[name], most), label="target")
            tokens[name] += len(new)
            computed[name] = target
            new_tokens[member].extend(new)
            members.append(member)
            targets.append(target)
            appends.append(len(new))
        step_ends.append(len(members))
    return DecodeStretch(list(request_ids), list(new_tokens), members, targets, appends, step_ends)


def summary(result: StretchAllocations) -> tuple[object, ...]:
    """A result with each allocation's block ids (a pool's own) replaced by their count."""
    return (
        [(len(a.block_ids), a.cached_blocks, a.removed) for a in result.allocations],
        result.kv_events,
        result.events,
        result.stats,
        result.cost,
    )


MODES = {
    "events": {},
    "no events": {"enable_kv_cache_events": False},
    "run keys": {"enable_kv_cache_events": False, "run_keys": True},
}


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_a_stretch_is_allocate_steps_of_the_steps_it_stands_for(
    data: st.DataObject, mode: str
) -> None:
    """Random tables, a random stretch over them, a random probe (watched or not): the
    same result as `allocate_steps` of ``stretch.steps()`` in compact form, the same
    state after, and the same LRU (the eviction order of what is idle)."""
    capacity, one, two, names = twin_tables(data, 5, frees=False, **MODES[mode])
    stretch = drawn_stretch(data, capacity, two, names)
    probe = data.draw(st.sampled_from([None, *names]), label="probe")
    watch = probe is not None and data.draw(st.booleans(), label="watch")
    watched = two.prefill_cost(probe) if watch and probe is not None else None
    expected = StretchAllocations.of_steps(
        two.allocate_steps(stretch.steps(), probe, stop_if_cost_changes=watched)
    )
    got = one.allocate_stretch(stretch, probe, stop_if_cost_changes=watched)
    event(f"steps tried: {'all' if len(got.kv_events) == len(stretch.step_ends) else 'fewer'}")
    event(f"slots allocated: {'all' if len(got.allocations) == len(stretch.members) else 'fewer'}")
    event(f"evicted: {any(a.removed for a in got.allocations)}")
    assert summary(got) == summary(expected)
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_a_watched_probe_costs_what_it_is_asked_after_every_step(
    data: st.DataObject, mode: str
) -> None:
    """Random tables, idle cached blocks filling the rest of the pool, random steps, a
    waiting probe sharing a prefix with some of them, watched from its cost now:
    `allocate_steps` stops after the same step, with the same cost, as the steps taken
    one call each with the probe's `prefill_cost` asked afresh after each (the manager
    keeps a cost it knows while nothing it depends on moved: `KvManager._asked_cost`)."""
    capacity = data.draw(st.integers(3, 10), label="capacity")
    one, two = make(capacity=capacity, **MODES[mode]), make(capacity=capacity, **MODES[mode])
    pool = two.pool
    held = twin_requests(data, one, two, 4, frees=False, longest=16)
    names = list(held)
    prompts = list(held.values())
    while len(prompts) < 8 and pool.capacity > pool.num_active() + pool.num_inactive():
        # cached, then idle, until nothing is free: the steps' growths evict
        free = pool.capacity - pool.num_active() - pool.num_inactive()
        filler = data.draw(
            st.lists(st.integers(0, 3), min_size=BS, max_size=min(3, free) * BS),
            label="idle prompt",
        )
        name = f"f{len(prompts)}"
        prompts.append(filler)
        for manager in (one, two):
            manager.add_request(name, filler)
            manager.allocate(name, len(filler), cache=True)
            manager.free(name)
    shared = data.draw(st.sampled_from([[], *prompts]), label="w shares")
    cut = data.draw(st.integers(0, len(shared)), label="w shares up to")
    rest = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=8), label="w rest")
    for manager in (one, two):  # a request waiting for its first allocation
        manager.add_request("w", shared[:cut] + rest)
    stretch = drawn_stretch(data, capacity, two, names)
    probe = data.draw(st.sampled_from(["w", "w", *names]), label="probe")
    watched = two.prefill_cost(probe)
    got = one.allocate_steps(stretch.steps(), probe, stop_if_cost_changes=watched)
    expected = []
    cost = watched
    for slots in stretch.steps():
        step = two.allocate_steps([slots])[0]
        expected.append(step)
        cost = two.prefill_cost(probe)
        if len(step.allocations) < len(slots) or cost != watched:
            break
    event(f"probe waits: {not two.num_blocks(probe)}")
    event(f"stopped on a cost change: {cost != watched}")
    event(f"evicted: {any(a.removed for step in got for a in step.allocations)}")
    assert len(got) == len(expected)
    assert got[-1].cost == cost
    for mine, plain in zip(got, expected, strict=True):
        assert [(len(a.block_ids), a.removed) for a in mine.allocations] == [
            (len(a.block_ids), a.removed) for a in plain.allocations
        ]
        assert (mine.events, mine.stats) == (plain.events, plain.stats)
    assert same_state(one, two)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_watched_cost_moves_when_its_first_missing_block_is_stored(mode: str) -> None:
    """The probe's next block, cached by another request's step, extends its hit:
    no eviction and no reuse, only a Stored hash, moves the watched cost."""
    manager = make(capacity=8, **MODES[mode])
    manager.add_request("r", [0, 1, 2, 3, 0, 1, 2, 3])
    assert manager.allocate("r", 4, cache=True) is not None
    manager.add_request("w", [0, 1, 2, 3, 0, 1, 2, 3, 1])
    watched = manager.prefill_cost("w")
    assert watched.cached_blocks == 1
    steps = [[SlotRequest("r", 5)], [SlotRequest("r", 8)], [SlotRequest("r", 8)]]
    result = manager.allocate_steps(steps, "w", stop_if_cost_changes=watched)
    assert len(result) == 2  # the second step stores w's second block
    assert result[-1].cost == manager.prefill_cost("w") == PrefillCost(2, 2, 1)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_watched_cost_moves_when_a_first_copy_that_was_not_the_last_is_evicted(
    mode: str,
) -> None:
    """Two copies of one hash, the first idle, the other held: evicting the first keeps
    the hash resident (nothing removed) but makes the held copy the first, so the
    probe's active hits move."""
    manager = make(capacity=4, **MODES[mode])
    prompt = [0, 1, 2, 3, 7]
    manager.add_request("r0", prompt)
    assert manager.allocate("r0", 5) is not None  # not cached yet
    manager.add_request("r1", prompt)
    assert manager.allocate("r1", 5, cache=True) is not None  # the first copy
    manager.mark_computed("r0", 5)  # r0's block: a second copy of the hash
    manager.free("r1")  # the first copy goes idle
    manager.add_request("w", prompt)
    watched = manager.prefill_cost("w")
    assert watched == PrefillCost(1, 0, 1)
    manager.append_tokens("r0", list(range(8)))
    result = manager.allocate_steps([[SlotRequest("r0", 13)]], "w", stop_if_cost_changes=watched)
    assert [a.removed for a in result[0].allocations] == [[]]  # the hash stays resident
    assert result[-1].cost == manager.prefill_cost("w") == PrefillCost(1, 1, 1)


def two_holders() -> KvManager:
    """ "a" and "b" hold one block each (3 tokens, all computed); "w" waits."""
    manager = make(capacity=8)
    for name, first in (("a", 0), ("b", 10)):
        manager.add_request(name, list(range(first, first + 3)))
        assert manager.allocate(name, 3, cache=True) is not None
    manager.add_request("w", list(range(20, 29)))
    return manager


GOOD = DecodeStretch(["a", "b"], [[5], [6, 7]], [0, 1, 1], [4, 4, 5], [1, 1, 1], [2, 3])


@pytest.mark.parametrize(
    ("stretch", "error"),
    [
        ("not a stretch", InvalidArgumentError),
        (DecodeStretch(("a",), [[]], [0], [3], [0], [1]), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeStretch(["a", "b"], [[5]], [0], [4], [1], [1]), InvalidArgumentError),
        (DecodeStretch(["a"], [[5]], [0], [4], [1, 0], [1]), InvalidArgumentError),
        (DecodeStretch(["a"], [[5]], [0], [4], [1], [0]), InvalidArgumentError),  # slot left out
        (DecodeStretch(["a"], [[5]], [0], [4], [1], []), InvalidArgumentError),
        (
            DecodeStretch(["a", "b"], [[5], [6]], [0, 1], [4, 4], [1, 1], [2, 1, 2]),
            InvalidArgumentError,  # step ends decrease
        ),
        (DecodeStretch(["a"], [[5]], [1], [4], [1], [1]), InvalidArgumentError),  # no member 1
        (DecodeStretch(["a", "a"], [[5], []], [0], [4], [1], [1]), InvalidArgumentError),
        (DecodeStretch(["a"], [[5, 6]], [0, 0], [4, 5], [1, 1], [2]), InvalidArgumentError),
        (DecodeStretch(["x"], [[5]], [0], [4], [1], [1]), UnknownRequestError),
        (DecodeStretch(["w"], [[5]], [0], [10], [1], [1]), InvalidArgumentError),  # no block
        (DecodeStretch(["a"], [[5]], [0], [4], [2], [1]), InvalidArgumentError),  # 2 of 1 token
        (DecodeStretch(["a"], [[5, 6]], [0], [4], [1], [1]), InvalidArgumentError),  # 6 unplaced
        (DecodeStretch(["a"], [[5]], [0], [5], [1], [1]), TokenCountError),
        (DecodeStretch(["a"], [[5]], [0], [4], [-1], [1]), InvalidArgumentError),
        (DecodeStretch(["a"], [[2**32]], [0], [4], [1], [1]), InvalidArgumentError),
        (DecodeStretch(["a"], [list(range(40))], [0], [43], [40], [1]), CapacityError),
        # items of the wrong type: typed errors, never a bare TypeError
        (DecodeStretch([3], [[5]], [0], [4], [1], [1]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeStretch(["a"], [[5]], ["0"], [4], [1], [1]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeStretch(["a"], [[5]], [0], ["4"], [1], [1]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeStretch(["a"], [[5]], [0], [4], [1.0], [1]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeStretch(["a"], [[5]], [0], [4], [1], [1.0]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeStretch(["a"], [5], [0], [4], [1], [1]), InvalidArgumentError),  # type: ignore[list-item]
    ],
)
def test_a_bad_stretch_raises_and_changes_nothing(stretch: Any, error: type[PoolError]) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(error):
        manager.allocate_stretch(stretch)
    assert snapshot(manager) == before
    assert summary(manager.allocate_stretch(GOOD)) == summary(
        StretchAllocations.of_steps(two_holders().allocate_steps(GOOD.steps()))
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate_stretch(GOOD, "x"),  # an unknown probe
        lambda m: m.allocate_stretch(GOOD, None, stop_if_cost_changes=PrefillCost(0, 0, 3)),
        lambda m: m.allocate_stretch(GOOD, "w", stop_if_cost_changes=(0, 0, 3)),
    ],
)
def test_a_bad_probe_raises_and_changes_nothing(call: Callable[[KvManager], object]) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(PoolError):
        call(manager)
    assert snapshot(manager) == before


def test_a_stretch_that_does_not_fit_stops_at_the_slot_keeping_its_tokens() -> None:
    """The pool holds two blocks, both in use: the second slot's growth does not fit,
    so the result has one allocation, one step tried, and that slot's token appended."""
    manager = make(capacity=2)
    for name, first in (("a", 0), ("b", 10)):
        manager.add_request(name, list(range(first, first + 4)))
        assert manager.allocate(name, 4, cache=True) is not None
    stretch = DecodeStretch(["a", "b"], [[], [9]], [0, 1], [4, 5], [0, 1], [2])
    got = manager.allocate_stretch(stretch)
    assert [len(a.block_ids) for a in got.allocations] == [0]
    assert len(got.kv_events) == 1
    assert manager.num_tokens("b") == 5


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_finish_stretch_is_the_stretch_then_finish_step(data: st.DataObject, mode: str) -> None:
    """`finish_stretch` of a random stretch and random frees: the same results, state
    and LRU as `allocate_stretch` then `finish_step` of the same updates."""
    capacity, one, two, names = twin_tables(data, 5, frees=False, **MODES[mode])
    stretch = drawn_stretch(data, capacity, two, names)
    freed = data.draw(st.lists(st.sampled_from(names), unique=True), label="freed")
    updates = [StepUpdate(name, [], -1, True) for name in freed]
    expected = (two.allocate_stretch(stretch), two.finish_step(updates))
    got = one.finish_stretch(stretch, updates)
    event(f"frees: {len(freed)}")
    assert summary(got[0]) == summary(expected[0])
    assert got[1] == expected[1]
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


@pytest.mark.parametrize(
    ("stretch", "updates", "error"),
    [
        (GOOD, [StepUpdate("x", [], -1, True)], UnknownRequestError),  # the frees are checked first
        (GOOD, ["not an update"], InvalidArgumentError),
        (
            DecodeStretch(["x"], [[5]], [0], [4], [1], [1]),
            [StepUpdate("a", [], -1, True)],
            UnknownRequestError,
        ),
    ],
)
def test_a_bad_finish_stretch_raises_and_changes_nothing(
    stretch: Any, updates: Any, error: type[PoolError]
) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(error):
        manager.finish_stretch(stretch, updates)
    assert snapshot(manager) == before
    assert "a" in manager  # a bad stretch frees nothing either
