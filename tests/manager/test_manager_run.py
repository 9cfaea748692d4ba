"""`KvManager.allocate_run`: a decode run in closed form is `allocate_stretch` of the
stretch it stands for (`DecodeRun.stretch`), result for result (its allocations joined
per request) and state for state, and a bad run is a typed error that changes nothing;
`KvManager.finish_run` is the run then `finish_step`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, evict_order, make, same_state, snapshot, twin_tables
from test_manager_stretch import MODES, two_holders

from kvpool.errors import (
    CapacityError,
    InvalidArgumentError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.manager import (
    DecodeRun,
    DecodeStretch,
    KvManager,
    PrefillCost,
    RunAllocations,
    StepUpdate,
    StretchAllocations,
)
from kvpool.pool.runs import expand_descents


def drawn_run(
    data: st.DataObject, capacity: int, manager: KvManager, names: list[str]
) -> DecodeRun:
    """A random run over some of the requests of ``names`` that hold blocks: a number of
    steps, then per request random new tokens, a first target its tokens allow, and the
    first growth and fill steps either as the engine computes them (its table's end, its
    next block's end) or drawn at random."""
    holders = [name for name in names if manager.num_blocks(name)]
    chosen = (
        data.draw(st.lists(st.sampled_from(holders), min_size=1, unique=True), label="requests")
        if holders
        else []
    )
    steps = data.draw(st.integers(1, 3 * BS + 2), label="steps")
    request_ids: list[str] = []
    new_tokens: list[list[int]] = []
    targets: list[int] = []
    grows: list[int] = []
    fills: list[int] = []
    for name in chosen:
        new = data.draw(st.lists(st.integers(0, 3), max_size=2 * BS), label=f"{name} new")
        held = manager.num_tokens(name) + len(new)
        if data.draw(st.booleans(), label=f"{name} as the engine"):
            target = data.draw(st.integers(0, held), label=f"{name} target")
            grow = manager.num_blocks(name) * BS - target + 1
            fill = -target % BS
        else:
            target = data.draw(st.integers(0, held), label=f"{name} target")
            grow = data.draw(st.integers(-1, steps - 1), label=f"{name} grow")
            fill = data.draw(st.integers(-1, steps - 1), label=f"{name} fill")
        grow = grow if 0 <= grow < steps else -1
        fill = fill if 0 <= fill < steps else -1
        if grow < 0 and fill < 0:
            continue
        last = max(first + (steps - 1 - first) // BS * BS for first in (grow, fill) if first >= 0)
        if target + last > min(held, capacity * BS):
            continue  # a target past its tokens or the pool: a bad run, tested apart
        if len(new) < last - min(first for first in (grow, fill) if first >= 0):
            continue  # fewer tokens than a step each to its last slot: tested apart
        request_ids.append(name)
        new_tokens.append(new)
        targets.append(target)
        grows.append(grow)
        fills.append(fill)
    return DecodeRun(request_ids, list(new_tokens), targets, grows, fills, steps)


def as_run(stretch: DecodeStretch, result: StretchAllocations, n: int) -> tuple[object, ...]:
    """A stretch's result in a run's terms: per request its blocks counted, the removed
    hashes in one list, the slots that fit, and the per-group fields."""
    blocks = [0] * n
    removed: list[int] = []
    for k, allocation in enumerate(result.allocations):
        blocks[stretch.members[k]] += len(allocation.block_ids)
        removed += allocation.removed
    return (
        blocks,
        len(result.allocations),
        removed,
        result.kv_events,
        result.events,
        result.stats,
        result.cost,
    )


def summary(result: RunAllocations) -> tuple[object, ...]:
    """A run's result with each request's block ids (a pool's own) counted."""
    assert all(not a.removed for a in result.allocations)  # the run's, not a request's
    return (
        [len(a.block_ids) for a in result.allocations],
        result.slots,
        expand_descents(result.removed_runs),
        result.kv_events,
        result.events,
        result.stats,
        result.cost,
    )


def decoding(
    data: st.DataObject, **options: Any
) -> tuple[KvManager, KvManager, DecodeRun, list[str]]:
    """Two identical managers with decoding requests (prompts computed whole, some of
    them repeated; some requests finished again, so the LRU holds their blocks, some as
    duplicates of another's), and a run over the decoding ones as the engine plans it:
    each heard of up to two more tokens than the manager, hearing them and the run's
    tokens through its last slot, its table growing from its end and its blocks
    filling from its next block's end."""
    capacity = data.draw(st.integers(3, 16), label="capacity")
    one, two = make(capacity=capacity, **options), make(capacity=capacity, **options)
    names: list[str] = []
    lates: list[tuple[str, int]] = []
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    for i in range(data.draw(st.integers(1, 6), label="requests")):
        name = f"r{i}"
        prompt = data.draw(
            st.one_of(
                st.sampled_from(prompts), st.lists(st.integers(0, 9), min_size=1, max_size=14)
            ),
            label=name,
        )
        if len(prompt) > capacity * BS:
            continue
        late = data.draw(st.booleans(), label=f"{name} computed late")
        fits = True
        for manager in (one, two):
            manager.add_request(name, prompt)
            fits = manager.allocate(name, len(prompt), cache=not late) is not None and fits
        names.append(name)
        if not fits:
            for manager in (one, two):
                manager.free(name)
            names.pop()
        elif late:
            lates.append((name, len(prompt)))
    # Computed late, after the others: a prompt another request cached meanwhile gets
    # copies of its own (duplicates).
    for name, length in lates:
        for manager in (one, two):
            manager.mark_computed(name, length)
    for name in list(names):
        if data.draw(st.booleans(), label=f"{name} finished"):
            for manager in (one, two):
                manager.free(name)
            names.remove(name)
    steps = data.draw(st.integers(1, 4 * BS), label="steps")
    caching = two.enable_prefix_caching
    request_ids: list[str] = []
    new_tokens: list[list[int]] = []
    targets: list[int] = []
    grows: list[int] = []
    fills: list[int] = []
    for name in names:
        target = two.num_tokens(name) + data.draw(st.integers(0, 2), label=f"{name} pending")
        grow = two.num_blocks(name) * BS - target + 1
        fill = -target % BS if caching else -1
        grow = grow if 0 <= grow < steps else -1
        fill = fill if 0 <= fill < steps else -1
        if grow < 0 and fill < 0:
            continue
        last = max(first + (steps - 1 - first) // BS * BS for first in (grow, fill) if first >= 0)
        if target + last > capacity * BS:
            continue
        request_ids.append(name)
        new_tokens.append([7] * (target + last - two.num_tokens(name)))
        targets.append(target)
        grows.append(grow)
        fills.append(fill)
    return one, two, DecodeRun(request_ids, new_tokens, targets, grows, fills, steps), names


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_a_run_is_allocate_stretch_of_the_stretch_it_stands_for(
    data: st.DataObject, mode: str
) -> None:
    """Random tables, a random run over them, a random probe (watched or not): the same
    result as `allocate_stretch` of ``run.stretch()`` in the run's terms, the same state
    after, and the same LRU (the eviction order of what is idle)."""
    if data.draw(st.booleans(), label="as the engine plans"):
        one, two, run, names = decoding(data, **MODES[mode])
    else:
        capacity, one, two, names = twin_tables(data, 8, frees=True, **MODES[mode])
        run = drawn_run(data, capacity, two, names)
    event(f"requests in the run: {min(len(run.request_ids), 3)}")
    if not run.request_ids:
        return
    probe = data.draw(st.sampled_from([None, None, *names]), label="probe")
    watch = probe is not None and data.draw(st.booleans(), label="watch")
    watched = two.prefill_cost(probe) if watch and probe is not None else None
    stretch = run.stretch(BS)
    expected = as_run(
        stretch,
        two.allocate_stretch(stretch, probe, stop_if_cost_changes=watched),
        len(run.request_ids),
    )
    got = one.allocate_run(run, probe, stop_if_cost_changes=watched)
    event(f"slots fit: {'all' if got.slots == len(stretch.members) else 'fewer'}")
    event(f"evicted: {bool(got.removed_runs)}")
    assert summary(got) == expected
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_finish_run_is_the_run_then_finish_step(data: st.DataObject, mode: str) -> None:
    capacity, one, two, names = twin_tables(data, 8, frees=True, **MODES[mode])
    run = drawn_run(data, capacity, two, names)
    if not run.request_ids:
        return
    freed = data.draw(st.lists(st.sampled_from(names), unique=True), label="freed")
    updates = [StepUpdate(name, [], -1, True) for name in freed]
    expected = (two.allocate_run(run), two.finish_step(updates))
    got = one.finish_run(run, updates)
    assert summary(got[0]) == summary(expected[0])
    assert got[1] == expected[1]
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


def test_a_run_stands_for_its_slots_step_by_step() -> None:
    """Blocks of 4: "a" grows at steps 1 and 5 and fills at 0 and 4, "b" fills at 2 and
    6; each hears a token a step, the rest with its first slot, and a step's slots go in
    request order."""
    run = DecodeRun(
        ["a", "b"], [[7, 8, 9, 9, 9, 9, 9], [9, 9, 9, 9, 9]], [4, 10], [1, -1], [0, 2], 8
    )
    assert run.stretch(4) == DecodeStretch(
        ["a", "b"],
        [[7, 8, 9, 9, 9, 9, 9], [9, 9, 9, 9, 9]],
        [0, 0, 1, 0, 0, 1],
        [4, 5, 12, 8, 9, 16],
        [2, 1, 1, 3, 1, 4],
        [1, 2, 3, 4, 5, 6],
    )
    both = DecodeRun(["a", "b"], [[], []], [4, 4], [0, 0], [0, -1], 1)
    assert both.stretch(4) == DecodeStretch(["a", "b"], [[], []], [0, 1], [4, 4], [0, 0], [2])


def plain_stretch(run: DecodeRun, block_size: int) -> DecodeStretch:
    """`DecodeRun.stretch` read off its docstring, slot by slot: the model its compiled
    form is checked against."""
    slots = sorted(
        {
            (step, i)
            for i in range(len(run.request_ids))
            for first in (run.grows[i], run.fills[i])
            if first >= 0
            for step in range(first, run.steps, block_size)
        }
    )
    last = {i: step for step, i in slots}
    previous: dict[int, int] = {}
    members, targets, appends, step_ends = [], [], [], []
    for k, (step, i) in enumerate(slots):
        members.append(i)
        targets.append(run.targets[i] + step)
        if i in previous:
            appends.append(step - previous[i])
        else:  # all but a token a step from here to the last slot
            appends.append(len(run.new_tokens[i]) - (last[i] - step))
        previous[i] = step
        if k + 1 == len(slots) or slots[k + 1][0] != step:
            step_ends.append(k + 1)
    return DecodeStretch(
        list(run.request_ids), list(run.new_tokens), members, targets, appends, step_ends
    )


@given(
    st.integers(1, 6).flatmap(
        lambda steps: st.lists(
            st.tuples(
                st.integers(-1, steps - 1), st.integers(-1, steps - 1), st.integers(0, 9)
            ).filter(lambda t: t[0] >= 0 or t[1] >= 0),
            max_size=4,
        ).map(lambda rows: (steps, rows))
    ),
    st.integers(1, 4),
)
def test_a_runs_slots_are_the_plain_model(drawn: tuple[int, list[Any]], block_size: int) -> None:
    """Any run's stretch (its compiled spelling out) is the plain model's."""
    steps, rows = drawn
    run = DecodeRun(
        [f"r{i}" for i in range(len(rows))],
        [list(range(steps + 2)) for _ in rows],
        [target for _, _, target in rows],
        [grow for grow, _, _ in rows],
        [fill for _, fill, _ in rows],
        steps,
    )
    assert run.stretch(block_size) == plain_stretch(run, block_size)


GOOD = DecodeRun(["a", "b"], [[5], [6, 7]], [4, 4], [0, 0], [-1, 1], 2)


@pytest.mark.parametrize(
    ("run", "error"),
    [
        ("not a run", InvalidArgumentError),
        (DecodeRun(("a",), [[]], [3], [0], [-1], 1), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeRun(["a", "b"], [[5]], [4, 4], [0, 0], [-1, -1], 1), InvalidArgumentError),
        (DecodeRun(["a"], [[5]], [4], [0], [-1], 0), InvalidArgumentError),  # no step
        (DecodeRun(["a"], [[5]], [4], [0], [-1], 1.0), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeRun(["a"], [[5]], [4], [-1], [-1], 1), InvalidArgumentError),  # no slot
        (DecodeRun(["a"], [[5]], [4], [1], [-1], 1), InvalidArgumentError),  # past the run
        (DecodeRun(["a"], [[5]], [4], [-2], [0], 1), InvalidArgumentError),
        (DecodeRun(["a"], [[5]], [-1], [0], [-1], 1), InvalidArgumentError),
        (DecodeRun(["a"], [[5]], ["4"], [0], [-1], 1), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeRun(["a", "a"], [[5], []], [4, 4], [0, 0], [-1, -1], 1), InvalidArgumentError),
        (DecodeRun(["x"], [[5]], [4], [0], [-1], 1), UnknownRequestError),
        (DecodeRun(["w"], [[5]], [10], [0], [-1], 1), InvalidArgumentError),  # no block
        (DecodeRun(["a"], [[5]], [5], [0], [-1], 1), TokenCountError),
        (DecodeRun(["a"], [[5]], [4], [0], [1], 2), TokenCountError),  # step 1 targets 5
        (DecodeRun(["a"], [[]], [3], [0], [1], 2), InvalidArgumentError),  # no token for step 1
        (DecodeRun(["a"], [[2**32]], [4], [0], [-1], 1), InvalidArgumentError),
        (DecodeRun(["a"], [list(range(40))], [43], [0], [-1], 1), CapacityError),
        (DecodeRun([3], [[5]], [4], [0], [-1], 1), InvalidArgumentError),  # type: ignore[list-item]
    ],
)
def test_a_bad_run_raises_and_changes_nothing(run: Any, error: type[PoolError]) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(error):
        manager.allocate_run(run)
    assert snapshot(manager) == before
    stretch = GOOD.stretch(BS)
    assert summary(manager.allocate_run(GOOD)) == as_run(
        stretch, two_holders().allocate_stretch(stretch), 2
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate_run(GOOD, "x"),  # an unknown probe
        lambda m: m.allocate_run(GOOD, None, stop_if_cost_changes=PrefillCost(0, 0, 3)),
        lambda m: m.allocate_run(GOOD, "w", stop_if_cost_changes=(0, 0, 3)),
        lambda m: m.finish_run(GOOD, [StepUpdate("x", [], -1, True)]),
        lambda m: m.finish_run(GOOD, ["not an update"]),
    ],
)
def test_a_bad_probe_or_update_raises_and_changes_nothing(
    call: Callable[[KvManager], object],
) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(PoolError):
        call(manager)
    assert snapshot(manager) == before


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_run_that_evicts_a_duplicate_counts_no_removed_event_for_it(mode: str) -> None:
    """ "b" cached its copies of a prompt after "a" cached its own: once "b" finishes,
    the LRU holds duplicates, and a growth that evicts one removes no hash (no Removed
    event): the same as the stretch slot by slot."""
    managers = []
    for _ in range(2):
        manager = make(capacity=4, **MODES[mode])
        prompt = list(range(8))
        manager.add_request("b", prompt)
        assert manager.allocate("b", 8) is not None  # private until computed
        manager.add_request("a", prompt)
        assert manager.allocate("a", 8, cache=True) is not None  # misses: fresh copies
        manager.mark_computed("b", 8)  # its copies are duplicates of a's
        manager.free("b")
        managers.append(manager)
    one, two = managers
    run = DecodeRun(["a"], [[8]], [9], [0], [-1], 1)
    stretch = run.stretch(BS)
    expected = as_run(stretch, two.allocate_stretch(stretch), 1)
    got = one.allocate_run(run)
    assert summary(got) == expected
    assert got.removed_runs == []  # the evicted copy's hash stays resident in a's
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)
