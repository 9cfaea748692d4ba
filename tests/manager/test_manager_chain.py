"""`KvManager.finish_chain`: a `DecodeChain` is `finish_run` of each of its segments
(`DecodeChain.segments`) in order, result for result (joined into one
`ChainAllocations`) and state for state, whichever way the manager does it (at once,
with events off, or segment by segment), stopping at a segment whose run stops short;
and a bad chain is a typed error that changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, evict_order, make, same_state, snapshot, twin_tables
from test_manager_run import GOOD, decoding, drawn_run, summary
from test_manager_stretch import MODES, two_holders

from kvpool.errors import (
    InvalidArgumentError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.events import KVEvent
from kvpool.manager import (
    Allocation,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    KvManager,
    RunAllocations,
    StepOutcome,
    StepUpdate,
)
from kvpool.pool.runs import add_descent, extend_runs


def by_hand(manager: KvManager, chain: DecodeChain) -> ChainAllocations:
    """The contract, call by call: for each segment, `allocate_run` of its run (if any),
    stopping when a slot did not fit, then `finish_step` of its frees (if any); the
    results joined as `ChainAllocations` has them."""
    run = chain.run
    place = {request_id: i for i, request_id in enumerate(run.request_ids)}
    joined: list[list[int]] = [[] for _ in run.request_ids]
    removed: list[int] = []
    kv_events: list[int] = []
    events: list[tuple[int, list[KVEvent]]] = []
    outcomes: list[StepOutcome] = []
    groups: list[int] = []
    slots = 0
    stats = manager.stats()
    for piece, updates in chain.segments(BS):
        if piece is not None:
            result = manager.allocate_run(piece)
            for request_id, allocation in zip(piece.request_ids, result.allocations, strict=True):
                extend_runs(joined[place[request_id]], allocation.block_runs)
            for r in range(0, len(result.removed_runs), 2):
                add_descent(removed, result.removed_runs[r], result.removed_runs[r + 1])
            events += [(group + len(kv_events), queued) for group, queued in result.events]
            kv_events += result.kv_events
            slots += result.slots
            stats = result.stats
            if result.slots < len(piece.stretch(BS).members):
                break  # a slot did not fit: nothing after it is tried
        if updates:
            outcomes.append(manager.finish_step(updates))
            groups.append(len(kv_events))
    allocations = [Allocation(blocks, 0, []) for blocks in joined]
    return ChainAllocations(
        RunAllocations(allocations, slots, removed, kv_events, events, stats, None),
        outcomes,
        groups,
    )


def first_slots(run: DecodeRun) -> dict[str, int]:
    """Each of the run's requests' first slot's step."""
    return {
        request_id: min(first for first in (grow, fill) if first >= 0)
        for request_id, grow, fill in zip(run.request_ids, run.grows, run.fills, strict=True)
    }


def drawn_chain(
    data: st.DataObject, run: DecodeRun, names: list[str], *, early: bool = False
) -> DecodeChain:
    """``run`` with random ascending leaves (with ``early``, the first at the first step
    a request of ``names`` can leave in), each freeing a non-empty list of requests of
    ``names`` (registered), members of the run (mostly) or not, none twice, a member
    only at or after its first slot (a leave with none left to free is dropped)."""
    first = first_slots(run)
    most = data.draw(st.sampled_from([0, 1, 2, 4, 4]), label="most leaves") if names else 0
    low = min([first.get(name, 0) for name in names], default=0)  # the first leave possible
    drawn = data.draw(
        st.sets(st.integers(low, run.steps - 1), min_size=min(most, 1), max_size=most),
        label="leaves",
    )
    if early and names:
        drawn.add(low)
    leaves: list[int] = []
    frees: list[list[str]] = []
    left = list(names)
    for leave in sorted(drawn):
        candidates = [name for name in left if first.get(name, leave) <= leave]
        members = [name for name in candidates if name in first]
        if not candidates:
            continue
        pick = st.sampled_from(candidates)
        if members:
            pick = st.one_of(st.sampled_from(members), pick)
        freed = data.draw(
            st.lists(pick, min_size=1, max_size=3, unique=True), label=f"freed after {leave}"
        )
        leaves.append(leave)
        frees.append(freed)
        left = [name for name in left if name not in freed]
    return DecodeChain(run, leaves, frees)


def fill_up(
    data: st.DataObject, one: KvManager, two: KvManager, *, full: bool = False
) -> list[str]:
    """Prompts of fresh tokens added to both managers, each cached then idle or kept
    running (holding its blocks), until at most a drawn number of blocks are
    unallocated (with ``full``, none, every prompt kept): the chain's growths evict,
    or fit only once its frees made room. Returns the names of those kept."""
    pool = two.pool
    spare = 0 if full else data.draw(st.sampled_from([0, 0, 1, 2]), label="unallocated left")
    kept: list[str] = []
    k = 0
    while pool.capacity - pool.num_active() - pool.num_inactive() > spare:
        free = pool.capacity - pool.num_active() - pool.num_inactive() - spare
        size = data.draw(st.integers(BS, min(3, free) * BS), label="filler tokens")
        # without caching a freed prompt's blocks are unallocated again: kept, all
        keep = (
            full
            or not two.enable_prefix_caching
            or data.draw(st.sampled_from([True, True, False]), label="filler kept")
        )
        name = f"f{k}"
        prompt = list(range(100 * (k + 1), 100 * (k + 1) + size))
        k += 1
        for manager in (one, two):
            manager.add_request(name, prompt)
            assert manager.allocate(name, size, cache=True) is not None
            if not keep:
                manager.free(name)
        if keep:
            kept.append(name)
    return kept


def planned_growth(manager: KvManager, chain: DecodeChain) -> int:
    """The blocks the chain's tables grow by if every slot fits."""
    most: dict[str, int] = {}
    for piece, _ in chain.segments(BS):
        if piece is None:
            continue
        stretch = piece.stretch(BS)
        for member, target in zip(stretch.members, stretch.targets, strict=True):
            request_id = stretch.request_ids[member]
            most[request_id] = max(most.get(request_id, 0), target)
    return sum(
        max(0, -(-target // BS) - manager.num_blocks(request_id))
        for request_id, target in most.items()
    )


def all_slots(chain: DecodeChain) -> int:
    """The chain's slots, every segment's."""
    return sum(len(piece.stretch(BS).members) for piece, _ in chain.segments(BS) if piece)


def path(manager: KvManager, chain: DecodeChain) -> str:
    """Which way `finish_chain` goes (`_chain_at_once`'s conditions, read from outside)."""
    if manager.enable_kv_cache_events:
        return "segments (events on)"
    pool = manager.pool
    growth = planned_growth(manager, chain)
    unallocated = pool.capacity - pool.num_active() - pool.num_inactive()
    if growth > unallocated + pool.num_inactive():
        return "segments (growth exceeds the free blocks before the frees)"
    if growth > unallocated and not pool.evicts_last_copies(growth - unallocated):
        return "segments (evicts a duplicate)"
    return "at once (or extended)"


def assert_same(got: ChainAllocations, expected: ChainAllocations) -> None:
    assert summary(got.run) == summary(expected.run)
    assert got.run.removed_runs == expected.run.removed_runs
    assert got.outcomes == expected.outcomes
    assert got.groups == expected.groups


CACHING = {"caching": {}, "no caching": {"enable_prefix_caching": False}}


def check_chain(data: st.DataObject, options: dict[str, Any], *, pressed: bool) -> None:
    """Random tables, a random run over them, random leaves freeing random registered
    requests: `finish_chain` gives the contract's result (`by_hand` on a twin), the
    same state after and the same LRU. The pool is nearly full (of idle cached blocks
    and of running prompts, some of them freed by the chain) or not; ``pressed``: full
    of running prompts, the first leave as early as can be."""
    one, two, chain = twins_and_chain(data, options, pressed=pressed)
    compare(one, two, chain)


def twins_and_chain(
    data: st.DataObject, options: dict[str, Any], *, pressed: bool = False
) -> tuple[KvManager, KvManager, DecodeChain]:
    """Twin managers with random tables (as the engine plans them, or not), the pool
    nearly full or not (with ``pressed``: full of running prompts), and a random chain
    over them (`drawn_chain`)."""
    for _ in range(3):  # a run over no request: drawn again, at most twice
        if data.draw(st.booleans(), label="as the engine plans"):
            one, two, run, names = decoding(data, **options)
        else:
            capacity, one, two, names = twin_tables(data, 8, frees=True, **options)
            run = drawn_run(data, capacity, two, names)
        if run.request_ids:
            break
    if pressed or data.draw(st.sampled_from([True, True, False]), label="nearly full"):
        names += fill_up(data, one, two, full=pressed)
    return one, two, drawn_chain(data, run, names, early=pressed)


def compare(one: KvManager, two: KvManager, chain: DecodeChain) -> None:
    """`finish_chain` on ``one``, the contract by hand on its twin ``two``: the same
    result, state and LRU."""
    run = chain.run
    way = path(two, chain)
    event(way)
    event(f"requests in the run: {min(len(run.request_ids), 3)}")
    event(f"a segment with no slot: {any(p is None for p, _ in chain.segments(BS))}")
    event(f"leaves: {min(len(chain.leaves), 3)}")
    event(f"members freed: {any(n in run.request_ids for f in chain.frees for n in f)}")
    expected = by_hand(two, chain)
    got = one.finish_chain(chain)
    short = got.run.slots < all_slots(chain)
    event(f"stopped short: {short}")
    event(f"the frees made room: {'exceeds' in way and not short}")
    event(f"evicted: {bool(got.run.removed_runs)}")
    assert_same(got, expected)
    if not short:  # every leave's frees made
        assert len(got.outcomes) == len(chain.leaves)
        assert not any(name in one for freed in chain.frees for name in freed)
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)), st.sampled_from(sorted(CACHING)))
def test_a_chain_is_finish_run_of_each_segment(
    data: st.DataObject, mode: str, caching: str
) -> None:
    """Any chain over any tables: the contract's result and state (`check_chain`)."""
    check_chain(data, {**MODES[mode], **CACHING[caching]}, pressed=False)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)), st.sampled_from(sorted(CACHING)))
def test_a_chain_in_a_full_pool_grows_into_what_its_frees_give_back(
    data: st.DataObject, mode: str, caching: str
) -> None:
    """The pool full of running prompts, a leave as early as can be: whether a
    segment's growth fits depends on the frees before it, which the at-once path
    does not count on (it does the chain segment by segment then)."""
    check_chain(data, {**MODES[mode], **CACHING[caching]}, pressed=True)


def engine_run(data: st.DataObject, manager: KvManager, names: list[str]) -> DecodeRun:
    """A run over the requests of ``names`` as the engine plans it (`decoding`'s): each
    heard of up to two more tokens than ``manager``, every token a 7, its table growing
    from its end and its blocks filling from its next block's end."""
    steps = data.draw(st.integers(1, 3 * BS), label="steps")
    rows: list[tuple[str, list[int], int, int, int]] = []
    for name in names:
        target = manager.num_tokens(name) + data.draw(st.integers(0, 2), label=f"{name} pending")
        grow = manager.num_blocks(name) * BS - target + 1
        fill = -target % BS
        grow = grow if 0 <= grow < steps else -1
        fill = fill if 0 <= fill < steps else -1
        if grow < 0 and fill < 0:
            continue
        last = max(first + (steps - 1 - first) // BS * BS for first in (grow, fill) if first >= 0)
        if target + last > manager.pool.capacity * BS:
            continue
        rows.append((name, [7] * (target + last - manager.num_tokens(name)), target, grow, fill))
    return DecodeRun(
        [row[0] for row in rows],
        [row[1] for row in rows],
        [row[2] for row in rows],
        [row[3] for row in rows],
        [row[4] for row in rows],
        steps,
    )


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)))
def test_requests_decoding_the_same_tokens_cache_the_same_hashes(
    data: st.DataObject, mode: str
) -> None:
    """Requests with one prompt decoding the same tokens (some computed late: copies of
    their own), after one that ran ahead of them and finished (its blocks idle and
    resident): the chain caches a hash twice, or one resident already, what the at-once
    path leaves to the segments."""
    capacity = data.draw(st.integers(5, 12), label="capacity")
    one, two = make(capacity=capacity, **MODES[mode]), make(capacity=capacity, **MODES[mode])
    prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2 * BS), label="prompt")
    ahead = data.draw(st.integers(0, 2 * BS), label="ran ahead by")
    for manager in (one, two):
        if ahead:
            manager.add_request("ahead", [*prompt, *[7] * ahead])
            assert manager.allocate("ahead", len(prompt) + ahead, cache=True) is not None
            manager.free("ahead")
    names: list[str] = []
    lates: list[str] = []
    for i in range(data.draw(st.integers(2, 4), label="requests")):
        name = f"r{i}"
        late = data.draw(st.booleans(), label=f"{name} computed late")
        fits = True
        for manager in (one, two):
            manager.add_request(name, prompt)
            fits = manager.allocate(name, len(prompt), cache=not late) is not None and fits
        if not fits:
            for manager in (one, two):
                manager.free(name)
            continue
        names.append(name)
        if late:
            lates.append(name)
    for name in lates:
        for manager in (one, two):
            manager.mark_computed(name, len(prompt))
    run = engine_run(data, two, names)
    compare(one, two, drawn_chain(data, run, names))


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)), st.sampled_from(sorted(CACHING)))
def test_a_chain_with_no_leave_is_allocate_run_of_its_run(
    data: st.DataObject, mode: str, caching: str
) -> None:
    """No request leaves: one segment, the whole run, and no outcome."""
    options = {**MODES[mode], **CACHING[caching]}
    capacity, one, two, names = twin_tables(data, 8, frees=True, **options)
    if data.draw(st.booleans(), label="nearly full"):
        fill_up(data, one, two)
    run = drawn_run(data, capacity, two, names)
    if not run.request_ids:
        return
    expected = two.allocate_run(run)
    got = one.finish_chain(DecodeChain(run, [], []))
    event(
        f"slots fit: {'all' if got.run.slots == all_slots(DecodeChain(run, [], [])) else 'fewer'}"
    )
    assert summary(got.run) == summary(expected)
    assert got.run.removed_runs == expected.removed_runs
    assert (got.outcomes, got.groups) == ([], [])
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


def test_a_leaves_frees_make_room_for_the_steps_after_it() -> None:
    """The pool's two blocks held by "a" and "b": "a"'s growth at step 1 fits only once
    "b", leaving after step 0, gave its block back (idle, then evicted for it), where
    `finish_run` of the run and the same free stops short."""
    managers = []
    for _ in range(3):
        manager = make(capacity=2)
        for name, first in (("a", 0), ("b", 10)):
            manager.add_request(name, list(range(first, first + 4)))
            assert manager.allocate(name, 4, cache=True) is not None
        managers.append(manager)
    one, two, three = managers
    run = DecodeRun(["a"], [[7]], [4], [1], [0], 2)  # a fills at 0, grows at 1
    chain = DecodeChain(run, [0], [["b"]])
    got = one.finish_chain(chain)
    assert_same(got, by_hand(two, chain))
    assert [len(a.block_ids) for a in got.run.allocations] == [1]
    assert got.run.slots == 2
    assert len(got.run.removed_runs) == 2  # b's block's hash, evicted for good
    assert got.groups == [1]  # the step 0 group, then b's frees
    assert [len(outcome.events) for outcome in got.outcomes] == [0]  # drained by step 0
    assert "b" not in one
    assert same_state(one, two)
    alone, _ = three.finish_run(run, [StepUpdate("b", [], -1, True)])
    assert (alone.slots, [len(a.block_ids) for a in alone.allocations]) == (1, [0])
    assert "b" not in three
    assert three.num_blocks("a") == 1


def test_a_members_tokens_need_only_reach_its_leave() -> None:
    """ "a" hears one token: too few for its slots at steps 0 and 4 (a bad run), enough
    for its slot at step 0 when it leaves after it."""
    run = DecodeRun(["a"], [[5]], [4], [0], [-1], 5)
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError):
        manager.allocate_run(run)
    assert snapshot(manager) == before
    chain = DecodeChain(run, [0], [["a"]])
    twin = two_holders()
    assert_same(manager.finish_chain(chain), by_hand(twin, chain))
    assert "a" not in manager
    assert same_state(manager, twin)


# "a" and "b" hold 3 tokens each (`two_holders`): "a" grows at step 0, "b" fills at 1
LATE = DecodeRun(["a", "b"], [[5], [6]], [4, 3], [0, -1], [-1, 1], 2)
SHORT = DecodeRun(["a"], [[]], [3], [0], [1], 6)  # no token for its slot at step 1
PAST = DecodeRun(["a"], [[5]], [5], [0], [-1], 1)  # targets a token it does not hold
STRANGER = DecodeRun(["x"], [[5]], [4], [0], [-1], 1)
WAITING = DecodeRun(["w"], [[5]], [10], [0], [-1], 1)  # holds no block
NO_STEP = DecodeRun(["a"], [[5]], [4], [0], [-1], 0)
FLOAT_STEPS = DecodeRun(["a"], [[5]], [4], [0], [-1], 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("chain", "error"),
    [
        ("not a chain", InvalidArgumentError),
        (DecodeChain("not a run", [], []), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeChain(GOOD, (0,), [["w"]]), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeChain(GOOD, [0], (["w"],)), InvalidArgumentError),  # type: ignore[arg-type]
        (DecodeChain(GOOD, [1, 0], [["w"], ["a"]]), InvalidArgumentError),  # not ascending
        (DecodeChain(GOOD, [0, 0], [["w"], ["a"]]), InvalidArgumentError),
        (DecodeChain(GOOD, [2], [["w"]]), InvalidArgumentError),  # past the run's 2 steps
        (DecodeChain(GOOD, [-1], [["w"]]), InvalidArgumentError),
        (DecodeChain(GOOD, [0.0], [["w"]]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeChain(GOOD, [True], [["w"]]), InvalidArgumentError),
        (DecodeChain(GOOD, [0], [["w"], ["a"]]), InvalidArgumentError),  # more frees
        (DecodeChain(GOOD, [0, 1], [["w"]]), InvalidArgumentError),  # fewer frees
        (DecodeChain(GOOD, [0], [[]]), InvalidArgumentError),  # an empty list of frees
        (DecodeChain(GOOD, [0], [("w",)]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeChain(GOOD, [0], [["w", "w"]]), InvalidArgumentError),  # freed twice
        (DecodeChain(GOOD, [0, 1], [["a"], ["a"]]), InvalidArgumentError),
        (DecodeChain(GOOD, [0], [["x"]]), UnknownRequestError),
        (DecodeChain(GOOD, [0, 1], [["w"], ["x"]]), UnknownRequestError),
        (DecodeChain(GOOD, [0], [[3]]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeChain(GOOD, [0], [[["a"]]]), InvalidArgumentError),  # type: ignore[list-item]
        (DecodeChain(LATE, [0], [["b"]]), InvalidArgumentError),  # no step before it leaves
        (DecodeChain(LATE, [0], [["a", "b"]]), InvalidArgumentError),
        (DecodeChain(SHORT, [1], [["a"]]), InvalidArgumentError),  # its slots up to its leave
        # its run's errors, the frees not made either
        (DecodeChain(PAST, [0], [["b"]]), TokenCountError),
        (DecodeChain(STRANGER, [0], [["a"]]), UnknownRequestError),
        (DecodeChain(WAITING, [0], [["a"]]), InvalidArgumentError),
        (DecodeChain(NO_STEP, [], []), InvalidArgumentError),
        (DecodeChain(FLOAT_STEPS, [0], [["b"]]), InvalidArgumentError),
        (DecodeChain(FLOAT_STEPS, [], []), InvalidArgumentError),
    ],
)
def test_a_bad_chain_raises_and_changes_nothing(chain: Any, error: type[PoolError]) -> None:
    manager = two_holders()
    before = snapshot(manager)
    with pytest.raises(error):
        manager.finish_chain(chain)
    assert snapshot(manager) == before
    assert {"a", "b", "w"} <= set(manager)  # nothing freed
    good = DecodeChain(GOOD, [0], [["a", "w"]])
    assert_same(manager.finish_chain(good), by_hand(two_holders(), good))


def test_the_good_chains_the_bad_ones_are_made_of_are_good() -> None:
    """What the bad chains above change, one thing each, is a good chain unchanged."""
    for chain in (
        DecodeChain(GOOD, [0, 1], [["w"], ["a"]]),
        DecodeChain(GOOD, [1], [["w"]]),
        DecodeChain(LATE, [1], [["b"]]),
        DecodeChain(LATE, [0], [["a"]]),
        DecodeChain(DecodeRun(["a"], [[9]], [3], [0], [1], 6), [1], [["a"]]),  # SHORT's
        DecodeChain(DecodeRun(["a"], [[5]], [4], [0], [-1], 1), [0], [["b"]]),  # PAST's
    ):
        manager, twin = two_holders(), two_holders()
        assert_same(manager.finish_chain(chain), by_hand(twin, chain))
        assert same_state(manager, twin)
