"""`KvManager.schedule` carrying a `DecodeChain`: `finish_chain` of the chain, then the
step's schedule with the gate's headroom counted before the chain's frees (the manager
adds what they released), all in one call. Against its contract on a twin manager: the
chain by `finish_chain`, then `schedule` with the headroom the engine would count once
the chain's answer came. A bad schedule changes nothing, the chain included."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_manager import BS, evict_order, make, same_state, snapshot
from test_manager_chain import CACHING, assert_same, planned_growth, twins_and_chain
from test_manager_stretch import MODES

from kvpool.errors import InvalidArgumentError
from kvpool.manager import (
    AdmissionGate,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    KvManager,
    QueuedRequest,
    SlotRequest,
)


def gate(manager: KvManager, growth: int, data: st.DataObject) -> AdmissionGate:
    """A drawn gate whose headroom is what the engine counts before ``growth`` more
    blocks: the pool's free and evictable blocks, less the growth (the chain's frees
    not counted)."""
    pool = manager.pool
    return AdmissionGate(
        data.draw(st.sampled_from([BS, 4 * BS, 64 * BS]), label="budget"),
        pool.capacity - pool.num_active() - growth,
        data.draw(st.integers(0, 2), label="watermark"),
        data.draw(st.integers(0, 3), label="running"),
        data.draw(st.integers(1, 3), label="seats"),
    )


def drawn_queue(data: st.DataObject, capacity: int) -> list[QueuedRequest]:
    """New requests with prompts, some of them sharing a prefix with another."""
    shared = data.draw(st.lists(st.integers(0, 9), max_size=2 * BS), label="shared prefix")
    queue: list[QueuedRequest] = []
    for i in range(data.draw(st.integers(1, 3), label="queued")):
        tail = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=2 * BS), label="tail")
        prompt = [*shared, *tail][: capacity * BS]
        queue.append(QueuedRequest(f"q{i}", prompt))
    return queue


@settings(max_examples=250, deadline=None)
@given(st.data(), st.sampled_from(sorted(MODES)), st.sampled_from(sorted(CACHING)))
def test_a_step_carrying_a_chain_is_the_chain_then_the_step(
    data: st.DataObject, mode: str, caching: str
) -> None:
    """Random tables, a random chain over them (its growth fitting whole), the pool
    nearly full or not, then a queue of new requests: the same results, state and LRU
    as the chain's own call and then the step's, its gate counted after the frees."""
    options: dict[str, Any] = {**MODES[mode], **CACHING[caching]}
    one, two, chain = twins_and_chain(data, options)
    growth = planned_growth(two, chain)
    pool = two.pool
    fits = growth <= pool.capacity - pool.num_active()
    event(f"fits whole: {fits}")
    before = snapshot(one)
    bound = gate(one, growth, data)
    queue = drawn_queue(data, pool.capacity)
    if not fits:
        with pytest.raises(InvalidArgumentError, match="must fit whole"):
            one.schedule([], queue, bound, chain)
        assert snapshot(one) == before
        return
    got = one.schedule([], queue, bound, chain)
    chained = two.finish_chain(chain)
    exact = AdmissionGate(
        bound.budget,
        pool.capacity - pool.num_active(),
        bound.watermark,
        bound.running,
        bound.seats,
    )
    expected = two.schedule([], queue, exact)
    released = exact.headroom - bound.headroom + growth
    event(f"the frees released blocks: {released > 0}")
    event(f"admitted: {min(len(expected.costs), 2)}")
    assert type(got.run) is ChainAllocations
    assert_same(got.run, chained)
    assert got.costs == expected.costs
    assert got.step.cost == expected.step.cost
    assert [a.num_blocks for a in got.step.allocations] == [
        a.num_blocks for a in expected.step.allocations
    ]
    assert [a.cached_blocks for a in got.step.allocations] == [
        a.cached_blocks for a in expected.step.allocations
    ]
    assert got.step.stats == expected.step.stats
    assert same_state(one, two)
    assert evict_order(one) == evict_order(two)


def one_leaving() -> tuple[KvManager, DecodeChain]:
    """A manager with two decoding requests and a chain in which ``a`` grows a block
    and ``b`` (two blocks) leaves after its first step."""
    manager = make(capacity=8, enable_kv_cache_events=False)
    for name, prompt in (("a", list(range(BS))), ("b", list(range(50, 50 + BS + 1)))):
        manager.add_request(name, prompt)
        assert manager.allocate(name, len(prompt), cache=True) is not None
    # a (one full block) fills it in step 0 and grows in step 1, hearing one token
    run = DecodeRun(["a"], [[7]], [BS], [1], [0], 2)
    return manager, DecodeChain(run, [0], [["b"]])


def test_the_gate_gets_the_blocks_the_frees_released() -> None:
    """``b``'s two blocks go idle with its free: a headroom counted without the free
    admits a request that needs them, as the exact count would."""
    manager, chain = one_leaving()
    pool = manager.pool
    bound = pool.capacity - pool.num_active() - 1  # after a's growth, b's blocks held
    need = bound + 1  # fits only with b's blocks
    queue = [QueuedRequest("c", list(range(200, 200 + need * BS)))]
    outcome = manager.schedule([], queue, AdmissionGate(need * BS, bound, 0, 1, 1), chain)
    assert "b" not in manager
    assert [a.num_blocks for a in outcome.step.allocations] == [need]
    manager.check_invariants()


@pytest.mark.parametrize(
    ("slots", "queue", "match"),
    [
        ([SlotRequest("b", BS + 2, [7])], [], "freed by the step's chain"),
        ([], [QueuedRequest("b")], "freed by the step's chain"),
    ],
)
def test_a_step_naming_a_request_its_chain_frees_changes_nothing(
    slots: list[SlotRequest], queue: list[QueuedRequest], match: str
) -> None:
    manager, chain = one_leaving()
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError, match=match):
        manager.schedule(slots, queue, AdmissionGate(64, 4), chain)
    assert snapshot(manager) == before
    assert "b" in manager
