"""The request-level manager: block tables, the visibility watermark, events, release order."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolationError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.events import BlockRemoved, BlockStored
from kvpool.hashing import TOKEN_TYPECODE, block_hashes
from kvpool.manager import Allocation, KvManager, PrefillCost, StepUpdate
from kvpool.manager import SlotRequest as Slot
from kvpool.pool import BlockPool

BS = 4


def make(capacity: int = 16, **kwargs: Any) -> KvManager:
    return KvManager(BlockPool(capacity), BS, **kwargs)


def run(manager: KvManager, request_id: str, tokens: list[int]) -> Allocation:
    """Admit a request, allocate and compute all its tokens; return the allocation."""
    manager.add_request(request_id, tokens)
    allocation = manager.allocate(request_id, len(tokens))
    assert allocation is not None
    manager.mark_computed(request_id, len(tokens))
    return allocation


def evict_order(manager: KvManager) -> list[int]:
    """Evict every inactive block through a raw reservation; the removed hashes, in order."""
    pool = manager.pool
    outcome = pool.reserve([], pool.capacity - pool.num_active())
    assert outcome is not None
    pool.cancel(outcome.reservation)
    assert pool.num_inactive() == 0
    return outcome.removed


def snapshot(manager: KvManager) -> tuple[object, ...]:
    pool = manager.pool
    manager.check_invariants()
    tables = {
        rid: (
            manager.block_table(rid),
            manager.num_tokens(rid),
            manager.num_computed_tokens(rid),
        )
        for rid in manager
    }
    return (
        pool.num_active(),
        pool.num_inactive(),
        pool.num_active_refs(),
        tables,
        manager.num_pending_events,
        manager.stats(),
    )


def same_state(one: KvManager, two: KvManager) -> bool:
    """Two managers over different pools agree on everything but the block ids (a
    pool's own): counts, each request's table length, tokens and computed count."""
    first, second = snapshot(one), snapshot(two)

    def sized(tables: Any) -> dict[str, tuple[int, int, int]]:
        return {rid: (len(ids), n, computed) for rid, (ids, n, computed) in tables.items()}

    return (
        first[:3] == second[:3]
        and sized(first[3]) == sized(second[3])
        and first[4:] == second[4:]
        and [one.num_tokens(r) for r in one] == [two.num_tokens(r) for r in two]
        and [one.prefill_cost(r) for r in one] == [two.prefill_cost(r) for r in two]
    )


# ------------------------------------------------------------------ the watermark


def test_full_block_becomes_visible_only_when_computed_covers_it_whole() -> None:
    manager = make()
    tokens = list(range(100, 110))  # 10 tokens: blocks [4, 4, 2]
    h0, h1 = block_hashes(tokens, BS)
    manager.add_request("a", tokens)
    allocation = manager.allocate("a", 10)
    assert allocation is not None
    assert len(allocation.block_ids) == 3
    assert allocation.cached_blocks == 0

    manager.mark_computed("a", 3)
    assert manager.pool.prefix_hit(h0) is None
    assert manager.take_events() == []

    manager.mark_computed("a", 7)  # covers block 0 whole, block 1 only partly
    assert manager.pool.prefix_hit(h0) is not None
    assert manager.pool.prefix_hit(h1) is None
    assert manager.take_events() == [
        BlockStored(block_hashes=[h0], parent_block_hash=None, token_ids=tokens[:4], block_size=BS)
    ]

    manager.mark_computed("a", 10)  # block 1 whole; block 2 is a partial tail
    assert manager.take_events() == [
        BlockStored(block_hashes=[h1], parent_block_hash=h0, token_ids=tokens[4:8], block_size=BS)
    ]
    assert manager.pool.num_active() == 3
    manager.pool.check_invariants()


def test_partial_tail_is_promoted_when_it_fills() -> None:
    manager = make()
    prompt = list(range(10))
    run(manager, "a", prompt)
    manager.take_events()
    h = block_hashes([*prompt, 50, 51], BS)

    manager.append_tokens("a", [50])
    assert manager.allocate("a", 11) == Allocation([], 0, [])
    manager.mark_computed("a", 11)
    assert manager.take_events() == []  # 3 of 4 slots: still private

    manager.append_tokens("a", [51])
    assert manager.pool.prefix_hit(h[2]) is None  # full but not computed yet
    manager.mark_computed("a", 12)
    assert manager.take_events() == [
        BlockStored(
            block_hashes=[h[2]], parent_block_hash=h[1], token_ids=[8, 9, 50, 51], block_size=BS
        )
    ]
    assert manager.num_blocks("a") == 3


def test_over_allocated_future_blocks_stay_private() -> None:
    manager = make()
    tokens = list(range(16))
    h = block_hashes(tokens, BS)
    manager.add_request("a", tokens)
    assert manager.allocate("a", 16) is not None
    manager.mark_computed("a", 5)
    assert [manager.pool.prefix_hit(x) is not None for x in h] == [True, False, False, False]
    manager.free("a")
    # The cached block idles in the LRU; the three private blocks were freed at once.
    assert manager.pool.num_inactive() == 1
    assert manager.pool.num_active() == 0


def test_consecutive_new_blocks_form_one_stored_event() -> None:
    manager = make()
    tokens = list(range(13))
    h = block_hashes(tokens, BS)
    manager.add_request("a", tokens)
    assert manager.allocate("a", 13) is not None
    manager.mark_computed("a", 13)
    assert manager.take_events() == [
        BlockStored(block_hashes=h, parent_block_hash=None, token_ids=tokens[:12], block_size=BS)
    ]


def test_an_already_visible_block_splits_the_stored_group() -> None:
    manager = make()
    tokens = list(range(16))
    h = block_hashes(tokens, BS)
    # Someone else holds a cached copy of block 1's hash (not of its parent).
    pool = manager.pool
    outcome = pool.reserve([], 1)
    assert outcome is not None
    other = pool.allocate_private(outcome.reservation)
    pool.cancel(outcome.reservation)
    assert pool.cache_private(other, h[1])

    manager.add_request("a", tokens)
    assert manager.allocate("a", 16) is not None
    manager.mark_computed("a", 16)
    assert manager.take_events() == [
        BlockStored(
            block_hashes=[h[0]], parent_block_hash=None, token_ids=tokens[:4], block_size=BS
        ),
        BlockStored(
            block_hashes=h[2:], parent_block_hash=h[1], token_ids=tokens[8:], block_size=BS
        ),
    ]


def test_events_carry_the_managers_medium() -> None:
    manager = make(medium="CPU")
    run(manager, "a", list(range(8)))
    (event,) = manager.take_events()
    assert isinstance(event, BlockStored)
    assert event.medium == "CPU"


# ------------------------------------------------------------ prefix reuse


def test_first_allocation_reuses_the_resident_prefix() -> None:
    manager = make()
    shared = list(range(8))
    first = run(manager, "a", [*shared, 1, 2, 3])
    manager.take_events()
    manager.add_request("b", [*shared, 7, 7, 7, 7, 7])

    assert manager.prefill_cost("b") == PrefillCost(
        cached_blocks=2, active_cached_blocks=2, new_blocks=2
    )
    allocation = manager.allocate("b", 13)
    assert allocation is not None
    assert allocation.cached_blocks == 2
    assert allocation.block_ids[:2] == first.block_ids[:2]
    assert len(allocation.block_ids) == 4
    assert manager.num_computed_tokens("b") == 8
    assert manager.pool.num_active() == 3 + 2  # "a": 3 blocks, "b": 2 shared + 2 new

    stats = manager.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (11 + 13, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 24)

    manager.mark_computed("b", 13)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == block_hashes(shared, BS)[-1]
    assert stored.block_hashes == block_hashes([*shared, 7, 7, 7, 7, 7], BS)[2:]


def test_prefix_leaves_the_last_token_to_compute() -> None:
    manager = make()
    tokens = list(range(12))  # three full blocks, all cached after "a"
    run(manager, "a", tokens)
    manager.add_request("b", tokens)
    # vLLM caps a hit at num_tokens - 1 tokens: the last block is recomputed.
    assert manager.prefill_cost("b") == PrefillCost(2, 2, 1)
    allocation = manager.allocate("b", 12)
    assert allocation is not None
    assert allocation.cached_blocks == 2


def test_prefix_walk_stops_at_the_first_miss() -> None:
    manager = make()
    run(manager, "a", list(range(12)))
    manager.free("a")
    evicted = evict_order(manager)
    assert len(evicted) == 3
    run(manager, "c", list(range(4)) + [99] * 8)  # caches block 0 only (same tokens)
    manager.add_request("b", [*range(12), 5])
    assert manager.prefill_cost("b") == PrefillCost(1, 1, 3)


def test_only_the_first_allocation_reuses_a_prefix() -> None:
    manager = make()
    tokens = list(range(16))
    manager.add_request("b", tokens)
    first = manager.allocate("b", 4)  # nothing cached yet: one fresh block
    assert first is not None
    assert first.cached_blocks == 0

    a = run(manager, "a", tokens)  # "a" makes blocks 0..3 visible meanwhile
    manager.take_events()
    assert manager.prefill_cost("b") == PrefillCost(0, 0, 3)
    growth = manager.allocate("b", 16)
    assert growth is not None
    assert growth.cached_blocks == 0
    assert not set(growth.block_ids) & set(a.block_ids)
    assert manager.pool.num_active() == 8

    # "b" computes duplicates of visible hashes: copies, but no Stored event.
    manager.mark_computed("b", 16)
    assert manager.take_events() == []


def test_preempted_request_re_hits_its_own_inactive_blocks() -> None:
    manager = make()
    tokens = list(range(10))
    first = run(manager, "a", tokens)
    manager.take_events()
    manager.preempt("a")
    assert manager.num_blocks("a") == 0
    assert manager.num_computed_tokens("a") == 0
    assert manager.pool.num_inactive() == 2
    assert manager.prefill_cost("a") == PrefillCost(2, 0, 1)

    again = manager.allocate("a", 10)
    assert again is not None
    assert again.cached_blocks == 2
    assert again.block_ids[:2] == first.block_ids[:2]
    assert manager.num_computed_tokens("a") == 8
    manager.mark_computed("a", 10)
    assert manager.take_events() == []  # nothing new became visible
    stats = manager.stats()
    assert (stats.preemptions, stats.prefix_query_tokens, stats.prefix_hit_tokens) == (1, 20, 8)


def test_growth_after_decode_takes_fresh_blocks_only() -> None:
    manager = make()
    run(manager, "a", list(range(8)))
    manager.append_tokens("a", [1])
    growth = manager.allocate("a", 9)
    assert growth is not None
    assert (len(growth.block_ids), growth.cached_blocks) == (1, 0)
    assert manager.num_blocks("a") == 3


# ------------------------------------------------------------- release order


def test_completion_releases_the_table_leaf_first() -> None:
    manager = make()
    tokens = list(range(12))
    h = block_hashes(tokens, BS)
    run(manager, "a", tokens)
    manager.free("a")
    assert "a" not in manager
    assert evict_order(manager) == [h[2], h[1], h[0]]


def test_preemption_releases_the_table_leaf_first() -> None:
    manager = make()
    tokens = list(range(12))
    h = block_hashes(tokens, BS)
    run(manager, "a", tokens)
    manager.preempt("a")
    assert "a" in manager
    assert evict_order(manager) == [h[2], h[1], h[0]]


def test_eviction_under_pressure_takes_the_leaf_and_reports_one_removed_event() -> None:
    manager = make(capacity=4)
    tokens = list(range(12))
    h = block_hashes(tokens, BS)
    run(manager, "a", tokens)
    manager.free("a")
    manager.take_events()

    manager.add_request("b", [9] * 12)
    allocation = manager.allocate("b", 12)  # 3 new blocks: 1 free, 2 evicted
    assert allocation is not None
    assert allocation.removed == [h[2], h[1]]
    assert manager.take_events() == [BlockRemoved(block_hashes=[h[2], h[1]])]
    assert manager.stats().evictions == 2
    assert manager.pool.prefix_hit(h[0]) is not None


def test_removed_event_precedes_the_allocations_stored_event() -> None:
    manager = make(capacity=3)
    run(manager, "a", list(range(12)))
    manager.free("a")
    manager.take_events()
    run(manager, "b", [7] * 8)
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]


# ------------------------------------------------------------- does not fit


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    manager = make(capacity=4)
    run(manager, "a", list(range(9)))  # 3 blocks: 2 cached + a private tail
    manager.add_request("b", [*range(8), 5, 5, 5, 5, 5])  # 2 cached prefix + 2 new
    manager.add_request("c", [3] * 8)
    before = snapshot(manager)
    assert manager.allocate("b", 13) is None
    assert manager.allocate("c", 8) is None
    assert snapshot(manager) == before
    manager.free("a")
    assert manager.allocate("b", 13) is not None


def test_growth_that_does_not_fit_changes_nothing() -> None:
    manager = make(capacity=3)
    run(manager, "a", list(range(8)))
    run(manager, "x", [1])  # the last free block, private
    manager.append_tokens("a", [1])
    before = snapshot(manager)
    assert manager.allocate("a", 9) is None
    assert snapshot(manager) == before


def test_a_request_larger_than_the_pool_raises_capacity_error() -> None:
    manager = make(capacity=2)
    manager.add_request("a", list(range(9)))
    before = snapshot(manager)
    with pytest.raises(CapacityError):
        manager.allocate("a", 9)
    assert snapshot(manager) == before
    assert manager.allocate("a", 8) is not None


# ------------------------------------------------------------- misuse


def _misuse_manager() -> KvManager:
    manager = make()
    run(manager, "a", list(range(10)))
    manager.add_request("b", list(range(5)))
    return manager


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda m: m.allocate("nope", 1), UnknownRequestError),
        (lambda m: m.mark_computed("nope", 1), UnknownRequestError),
        (lambda m: m.append_tokens("nope", [1]), UnknownRequestError),
        (lambda m: m.free("nope"), UnknownRequestError),
        (lambda m: m.preempt("nope"), UnknownRequestError),
        (lambda m: m.prefill_cost("nope"), UnknownRequestError),
        (lambda m: m.num_blocks("nope"), UnknownRequestError),
        (lambda m: m.add_request("a", [1, 2]), DuplicateRequestError),
        (lambda m: m.allocate("b", 6), TokenCountError),
        (lambda m: m.allocate("b", -1), InvalidArgumentError),
        (lambda m: m.allocate("b", 1.0), InvalidArgumentError),
        (lambda m: m.allocate("b", True), InvalidArgumentError),
        (lambda m: m.mark_computed("a", 9), TokenCountError),
        (lambda m: m.mark_computed("a", 11), TokenCountError),
        (lambda m: m.mark_computed("b", 1), TokenCountError),  # holds no block yet
        (lambda m: m.mark_computed("a", "10"), InvalidArgumentError),
        (lambda m: m.add_request("c", [1, -1]), InvalidArgumentError),
        (lambda m: m.add_request("c", [1, 2**32]), InvalidArgumentError),
        (lambda m: m.add_request("c", [1, 2.0]), InvalidArgumentError),
        (lambda m: m.add_request("c", array("q", [1, -1])), InvalidArgumentError),
        (lambda m: m.add_request("c", "abc"), InvalidArgumentError),
        (lambda m: m.add_request(7, [1]), InvalidArgumentError),
        (lambda m: m.add_request(["x"], [1]), InvalidArgumentError),
        (lambda m: m.append_tokens("a", [2**32]), InvalidArgumentError),
        (lambda m: m.allocate(["a"], 1), InvalidArgumentError),
        (lambda m: m.allocate("b", 7, new_tokens=[1]), TokenCountError),
        (lambda m: m.allocate("b", 6, new_tokens=[2**32]), InvalidArgumentError),
        (lambda m: m.allocate("b", 6, new_tokens="x"), InvalidArgumentError),
        (lambda m: m.allocate("b", 17 * 4 + 1, new_tokens=range(64)), CapacityError),
        # a step's allocations: every slot is checked before the first is allocated
        (lambda m: m.allocate_step([Slot("b", 4), Slot("nope", 1)]), UnknownRequestError),
        (lambda m: m.allocate_step([Slot("b", 4), Slot("a", 12)]), TokenCountError),
        (lambda m: m.allocate_step([Slot("b", 4), Slot("a", -1)]), InvalidArgumentError),
        (lambda m: m.allocate_step([Slot("b", 4, [1]), Slot("b", 5)]), InvalidArgumentError),
        (lambda m: m.allocate_step([Slot("b", 4), ("a", 10)]), InvalidArgumentError),
        (lambda m: m.allocate_step("b"), InvalidArgumentError),
        (lambda m: m.allocate_step([Slot("b", 4)], "nope"), UnknownRequestError),
        (lambda m: m.allocate_step([Slot("b", 4), Slot("a", 11, [2**32])]), InvalidArgumentError),
        (
            lambda m: m.allocate_step([Slot("b", 4), Slot("a", 69, list(range(64)))]),
            CapacityError,
        ),
        # several steps' allocations: every step is checked before the first is allocated,
        # a request's tokens counted with those its earlier steps' slots append
        (lambda m: m.allocate_steps([]), InvalidArgumentError),
        (lambda m: m.allocate_steps([[Slot("b", 4)], "b"]), InvalidArgumentError),
        (lambda m: m.allocate_steps([[Slot("b", 4)], [Slot("nope", 1)]]), UnknownRequestError),
        (lambda m: m.allocate_steps([[Slot("b", 6, [1])], [Slot("b", 8, [2])]]), TokenCountError),
        (
            lambda m: m.allocate_steps([[Slot("b", 4)], [Slot("b", 5), Slot("b", 5)]]),
            InvalidArgumentError,
        ),
        (
            lambda m: m.allocate_steps([[Slot("b", 4)], [Slot("a", 10)]], "nope"),
            UnknownRequestError,
        ),
        (
            lambda m: m.allocate_steps([[Slot("b", 6, [1])], [Slot("b", 7, [2**32])]]),
            InvalidArgumentError,
        ),
        (
            lambda m: m.allocate_steps([[Slot("b", 4)]], stop_if_cost_changes=m.prefill_cost("b")),
            InvalidArgumentError,  # a watched cost needs a probe
        ),
        (
            lambda m: m.allocate_steps([[Slot("b", 4)]], "a", stop_if_cost_changes=(0, 0, 1)),
            InvalidArgumentError,
        ),
        # a step's updates, and the probe asked after them
        (lambda m: m.finish_step([StepUpdate("a", [], -1, True)], "nope"), UnknownRequestError),
        (lambda m: m.finish_step([StepUpdate("a", [], -1, True)], "a"), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate("nope", [], -1, True)], "b"), UnknownRequestError),
        # fields of the wrong type (the compiled manager reads them typed): typed errors
        (lambda m: m.allocate_steps([[Slot(3, 4)]]), InvalidArgumentError),
        (lambda m: m.allocate_steps([[Slot("b", "4")]]), InvalidArgumentError),
        (lambda m: m.allocate_steps([[Slot("b", 4, 5)]]), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate(3, [], -1, True)]), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate("b", 5, -1, False)]), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate("b", (1,), -1, False)]), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate("b", [], "4", False)]), InvalidArgumentError),
        (lambda m: m.finish_step([StepUpdate("a", [], -1, "yes")]), InvalidArgumentError),
    ],
)
def test_misuse_raises_a_typed_error_and_changes_nothing(call: Any, error: type[PoolError]) -> None:
    manager = _misuse_manager()
    before = snapshot(manager)
    with pytest.raises(error):
        call(manager)
    assert snapshot(manager) == before


def test_double_free_is_an_unknown_request() -> None:
    manager = _misuse_manager()
    manager.free("a")
    before = snapshot(manager)
    with pytest.raises(UnknownRequestError):
        manager.free("a")
    assert snapshot(manager) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": 2.0},
        {"enable_prefix_caching": 1},
        {"enable_kv_cache_events": None},
        {"medium": 3},
    ],
)
def test_bad_construction_raises_invalid_argument(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"block_size": BS, **kwargs}
    block_size = args.pop("block_size")
    with pytest.raises(InvalidArgumentError):
        KvManager(BlockPool(4), block_size, **args)


def test_a_pool_is_required() -> None:
    with pytest.raises(InvalidArgumentError):
        KvManager(4, BS)  # type: ignore[arg-type]


# ---------------------------------------------------- prefix caching disabled


def test_without_prefix_caching_blocks_stay_private_and_nothing_is_reused() -> None:
    manager = make(enable_prefix_caching=False)
    tokens = list(range(12))
    run(manager, "a", tokens)
    manager.add_request("b", tokens)
    assert manager.prefill_cost("b") == PrefillCost(0, 0, 3)
    allocation = manager.allocate("b", 12)
    assert allocation is not None
    assert allocation.cached_blocks == 0
    assert all(manager.pool.prefix_hit(x) is None for x in block_hashes(tokens, BS))
    manager.free("a")
    manager.free("b")
    assert (manager.pool.num_active(), manager.pool.num_inactive()) == (0, 0)
    assert manager.take_events() == []
    stats = manager.stats()
    # as vLLM: no prefix-cache stats without a prefix cache
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.evictions) == (0, 0, 0)


# ---------------------------------------------------------------- draining


def test_take_batch_drains_in_order_and_is_none_when_empty() -> None:
    manager = make(capacity=3)
    assert manager.take_batch(1.0) is None
    run(manager, "a", list(range(12)))
    manager.free("a")
    run(manager, "b", [5] * 8)
    batch = manager.take_batch(2.5, data_parallel_rank=1)
    assert batch is not None
    assert (batch.ts, batch.data_parallel_rank) == (2.5, 1)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, BlockStored]
    assert manager.num_pending_events == 0
    assert manager.take_batch(3.0) is None


@pytest.mark.parametrize(
    ("ts", "rank"),
    [
        (float("nan"), None),
        (float("inf"), 0),
        (-float("inf"), 0),
        ("1.0", 0),
        (None, 0),
        (True, 0),
        (1.0, -1),
        (1.0, 1.5),
        (1.0, "0"),
        (1.0, True),
    ],
)
def test_take_batch_refuses_a_bad_ts_or_rank_and_keeps_every_event(ts: Any, rank: Any) -> None:
    manager = make(capacity=3)
    run(manager, "a", list(range(12)))
    manager.free("a")
    pending = manager.num_pending_events
    assert pending > 0
    with pytest.raises(InvalidArgumentError):
        manager.take_batch(ts, data_parallel_rank=rank)
    assert manager.num_pending_events == pending  # refused: nothing taken
    batch = manager.take_batch(7, data_parallel_rank=0)  # an int ts is a time too
    assert batch is not None
    assert len(batch.events) == pending
    assert batch.ts == 7.0
    assert type(batch.ts) is float


def test_check_invariants_catches_a_stale_watermark() -> None:
    manager = make()
    run(manager, "a", list(range(10)))
    manager.check_invariants()
    manager._requests["a"].visible = 1  # corrupt on purpose: blocks 0 and 1 are visible
    with pytest.raises(InvariantViolationError, match="watermark"):
        manager.check_invariants()


# ------------------------------------------------------------------- undo


def test_undoing_a_first_allocation_restores_the_request_and_idles_its_prefix() -> None:
    manager = make()
    shared = list(range(8))
    run(manager, "a", [*shared, 1])
    manager.free("a")
    manager.take_events()
    manager.add_request("b", [*shared, 5, 5, 5])
    before = snapshot(manager)
    allocation = manager.allocate("b", 11)
    assert allocation is not None
    assert allocation.cached_blocks == 2
    assert manager.undo_allocation("b", allocation)
    after = snapshot(manager)
    # Same tables, capacity and LRU size; only the query counters moved.
    assert after[:5] == before[:5]
    assert manager.num_computed_tokens("b") == 0
    # The prefix went back leaf first: the leaf is still evicted before its parent.
    assert evict_order(manager) == block_hashes(shared, BS)[::-1]


def test_undoing_a_growth_clips_the_computed_count_and_keeps_stored_blocks_resident() -> None:
    manager = make()
    tokens = list(range(12))
    h = block_hashes(tokens, BS)
    manager.add_request("a", tokens)
    first = manager.allocate("a", 4)
    growth = manager.allocate("a", 12)
    assert first is not None
    assert growth is not None
    manager.mark_computed("a", 12)  # blocks 1 and 2 of the growth became visible
    manager.take_events()
    assert manager.undo_allocation("a", growth)
    assert manager.block_table("a") == first.block_ids
    assert manager.num_computed_tokens("a") == 4
    assert manager.pool.prefix_hit(h[2]) == manager.pool.prefix_hit(h[1])
    assert manager.pool.prefix_hit(h[1]) is not None
    assert manager.pool.num_inactive() == 2
    assert manager.take_events() == []
    manager.check_invariants()
    manager.mark_computed("a", 4)


def test_undo_is_a_no_op_once_the_blocks_went_back() -> None:
    manager = make()
    manager.add_request("a", list(range(8)))
    allocation = manager.allocate("a", 8)
    assert allocation is not None
    manager.preempt("a")
    before = snapshot(manager)
    assert not manager.undo_allocation("a", allocation)
    manager.free("a")
    assert not manager.undo_allocation("a", allocation)
    assert manager.undo_allocation("a", Allocation([], 0, []))
    assert snapshot(manager)[:3] == before[:3]


def test_undo_rejects_a_bad_allocation() -> None:
    manager = make()
    with pytest.raises(InvalidArgumentError):
        manager.undo_allocation("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        manager.undo_allocation(3, Allocation([], 0, []))  # type: ignore[arg-type]


def test_restored_events_come_back_ahead_of_newer_ones() -> None:
    manager = make(capacity=3)
    run(manager, "a", list(range(12)))
    manager.free("a")
    taken = manager.take_events()
    run(manager, "b", [5] * 8)
    newer = manager.take_events()
    manager.restore_events(newer)
    manager.restore_events(taken)
    assert manager.take_events() == taken + newer


def test_a_u32_array_prompt_is_copied_not_kept() -> None:
    """The engine hands prompts over as ``u32`` arrays, which skip the per-token check:
    the manager must still own its copy."""
    manager = make()
    prompt = array(TOKEN_TYPECODE, range(10))
    manager.add_request("a", prompt)
    prompt[0] = 99
    prompt.append(10)
    assert manager.num_tokens("a") == 10
    assert manager.block_hashes("a") == block_hashes(list(range(10)), BS)


def test_new_tokens_on_an_allocation_are_appending_them_first() -> None:
    """allocate(..., new_tokens=t) leaves the manager exactly as append_tokens(t) then
    allocate would: tokens, hashes, table, visible blocks, events."""
    one, two = make(), make()
    for manager in (one, two):
        run(manager, "a", list(range(15)))
    two.append_tokens("a", [100, 101, 102])
    expected = two.allocate("a", 17, cache=True)
    got = one.allocate("a", 17, cache=True, new_tokens=[100, 101, 102])
    assert got is not None
    assert expected is not None
    assert (len(got.block_ids), got.cached_blocks, got.removed) == (
        len(expected.block_ids),
        expected.cached_blocks,
        expected.removed,
    )
    assert same_state(one, two)
    assert one.take_events() == two.take_events()


def test_new_tokens_stay_appended_when_the_blocks_do_not_fit() -> None:
    """An allocation that does not fit changes nothing but the tokens it carried, as
    append_tokens then a refused allocate would."""
    one, two = make(capacity=2), make(capacity=2)
    for manager in (one, two):
        run(manager, "a", list(range(4)))
        run(manager, "b", list(range(50, 54)))
    two.append_tokens("a", [7])
    assert two.allocate("a", 5) is None
    assert one.allocate("a", 5, new_tokens=[7]) is None
    assert same_state(one, two)


def test_a_step_allocation_is_allocations_then_a_drain_and_a_stats_read() -> None:
    """allocate_step(slots) returns what allocate(..., cache=True, new_tokens=...) for
    each slot, take_events() and stats() would, in one call, and leaves the manager as
    they would."""
    one, two = make(capacity=6), make(capacity=6)
    for manager in (one, two):
        run(manager, "a", list(range(8)))
        manager.free("a")  # two cached blocks, idle: the allocations evict them
        manager.add_request("b", list(range(50, 62)))
        run(manager, "c", list(range(70, 76)))
    expected = [
        two.allocate("b", 12, cache=True),
        two.allocate("c", 9, cache=True, new_tokens=[1, 2, 3]),
    ]
    events, stats = two.take_events(), two.stats()
    got = one.allocate_step([Slot("b", 12), Slot("c", 9, [1, 2, 3])])
    assert [(len(a.block_ids), a.removed) for a in got.allocations] == [
        (len(a.block_ids), a.removed) for a in expected if a is not None
    ]
    assert [len(a.block_ids) for a in got.allocations] == [3, 1]
    assert got.allocations[0].removed != []
    assert (got.events, got.stats) == (events, stats)
    assert one.num_pending_events == 0
    assert same_state(one, two)


def test_a_step_allocation_stops_at_the_first_slot_that_does_not_fit() -> None:
    """The slot that does not fit keeps its new tokens appended (as allocate does); the
    slots after it are not tried: their new tokens are not appended either."""
    one, two = make(capacity=3), make(capacity=3)
    for manager in (one, two):
        run(manager, "a", list(range(4)))
        run(manager, "b", list(range(10, 14)))
        run(manager, "c", list(range(20, 24)))
        manager.add_request("d", list(range(30, 34)))
    assert two.allocate("a", 5, cache=True, new_tokens=[5]) is None
    got = one.allocate_step([Slot("a", 5, [5]), Slot("b", 5, [6])])
    assert got.allocations == []
    assert (one.num_tokens("a"), one.num_tokens("b")) == (5, 4)
    assert (got.events, got.stats) == (two.take_events(), two.stats())
    assert same_state(one, two)
    one.free("c")
    two.free("c")
    expected = two.allocate("a", 5, cache=True)
    assert expected is not None
    assert two.allocate("b", 5, cache=True, new_tokens=[6]) is None
    got = one.allocate_step([Slot("a", 5), Slot("b", 5, [6]), Slot("d", 1, [7])])
    assert [len(a.block_ids) for a in got.allocations] == [len(expected.block_ids)] == [1]
    assert (one.num_tokens("b"), one.num_tokens("d")) == (5, 4)
    assert (got.events, got.stats) == (two.take_events(), two.stats())
    assert same_state(one, two)


def twin_tables(
    data: st.DataObject, most: int, *, frees: bool, **options: Any
) -> tuple[int, KvManager, KvManager, list[str]]:
    """Two identical managers of a drawn capacity (and the `KvManager` ``options``)
    holding up to ``most`` random requests with random tables (some freed again if
    ``frees``); returns the capacity, both managers and the names of the requests still
    registered."""
    capacity = data.draw(st.integers(2, 12), label="capacity")
    one, two = make(capacity=capacity, **options), make(capacity=capacity, **options)
    return capacity, one, two, list(twin_requests(data, one, two, most, frees=frees))


def twin_requests(
    data: st.DataObject,
    one: KvManager,
    two: KvManager,
    most: int,
    *,
    frees: bool,
    longest: int = 12,
) -> dict[str, list[int]]:
    """Up to ``most`` random requests (prompts of at most ``longest`` tokens) added to two
    identical managers, each with a random table (some freed again if ``frees``, and
    those that do not fit); returns the prompts of those still registered, by name."""
    capacity = one.pool.capacity
    prompts: dict[str, list[int]] = {}
    for i in range(data.draw(st.integers(1, most), label="requests")):
        name = f"r{i}"
        prompt = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=longest), label=name)
        done = data.draw(st.integers(0, min(len(prompt), capacity * BS)), label=f"{name} has")
        fits = True
        for manager in (one, two):
            manager.add_request(name, prompt)
            if done:
                fits = manager.allocate(name, done, cache=True) is not None
        if not fits or (frees and data.draw(st.booleans(), label=f"{name} freed")):
            for manager in (one, two):
                manager.free(name)
        else:
            prompts[name] = prompt
    return prompts


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_step_allocation_is_sequential_allocations(data: st.DataObject) -> None:
    """Random tables, then random slots: allocate_step agrees with allocate called slot
    by slot until one returns None (same allocations, events, counters and state)."""
    capacity, one, two, names = twin_tables(data, 6, frees=True)
    order = data.draw(st.permutations(names), label="order")
    slots = []
    for name in order[: data.draw(st.integers(0, len(order)), label="slots")]:
        new = data.draw(st.lists(st.integers(0, 3), max_size=6), label=f"{name} new")
        most = min(two.num_tokens(name) + len(new), capacity * BS)  # never a CapacityError
        target = data.draw(st.integers(two.num_computed_tokens(name), most), label="target")
        slots.append(Slot(name, target, new))
    expected = []
    for slot in slots:
        allocation = two.allocate(
            slot.request_id, slot.num_tokens, cache=True, new_tokens=slot.new_tokens
        )
        if allocation is None:
            break
        expected.append(allocation)
    got = one.allocate_step(slots)
    assert [(len(a.block_ids), a.cached_blocks, a.removed) for a in got.allocations] == [
        (len(a.block_ids), a.cached_blocks, a.removed) for a in expected
    ]
    assert (got.events, got.stats) == (two.take_events(), two.stats())
    assert same_state(one, two)


def test_a_probe_is_the_prefill_cost_after_the_step_allocations() -> None:
    """The probed request's cost is asked after the slots, so it sees what they did:
    here the allocation evicts part of the prefix the probed request would have reused."""
    one, two = make(capacity=4), make(capacity=4)
    for manager in (one, two):
        run(manager, "a", list(range(8)))
        manager.free("a")  # two cached blocks, idle
        manager.add_request("b", list(range(50, 62)))
        manager.add_request("c", list(range(9)))  # would reuse a's two blocks
    assert two.prefill_cost("c") == PrefillCost(2, 0, 1)
    assert two.allocate("b", 12, cache=True) is not None  # evicts a's leaf block
    got = one.allocate_step([Slot("b", 12)], probe="c")
    assert got.cost == two.prefill_cost("c") == PrefillCost(1, 0, 2)
    assert one.allocate_step([]).cost is None


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_several_steps_allocations_are_one_step_allocation_per_step(data: st.DataObject) -> None:
    """Random tables, then random steps of random slots (a request in several steps, its
    tokens growing): allocate_steps agrees with allocate_step called step by step until
    one stops short, each step's events and counters its own, and the probe's cost
    after the last step tried."""
    capacity, one, two, names = twin_tables(data, 5, frees=False)
    tokens = {name: two.num_tokens(name) for name in names}
    computed = {name: two.num_computed_tokens(name) for name in names}
    steps = []
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        chosen = (
            data.draw(st.lists(st.sampled_from(names), unique=True), label="slots") if names else []
        )
        slots = []
        for name in chosen:
            new = data.draw(st.lists(st.integers(0, 3), max_size=5), label=f"{name} new")
            most = min(tokens[name] + len(new), capacity * BS)
            if most < computed[name]:
                continue
            target = data.draw(st.integers(computed[name], most), label="target")
            tokens[name] += len(new)
            computed[name] = target
            slots.append(Slot(name, target, new))
        steps.append(slots)
    probe = data.draw(st.sampled_from([None, *names]), label="probe")
    watch = probe is not None and data.draw(st.booleans(), label="watch")
    watched = two.prefill_cost(probe) if watch and probe is not None else None
    expected = []
    for slots in steps:
        outcome = two.allocate_step(slots)
        expected.append(outcome)
        if len(outcome.allocations) < len(slots):
            break
        if watched is not None and probe is not None and two.prefill_cost(probe) != watched:
            break  # this step changed the watched cost: the call stops after it
    got = one.allocate_steps(steps, probe, stop_if_cost_changes=watched)
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert [(len(a.block_ids), a.cached_blocks, a.removed) for a in mine.allocations] == [
            (len(a.block_ids), a.cached_blocks, a.removed) for a in theirs.allocations
        ]
        assert (mine.events, mine.stats) == (theirs.events, theirs.stats)
    assert [step.cost for step in got[:-1]] == [None] * (len(got) - 1)
    assert got[-1].cost == (None if probe is None else two.prefill_cost(probe))
    assert same_state(one, two)


def test_a_watched_cost_stops_the_steps_after_the_one_that_changes_it() -> None:
    """The probe's cost is asked after every step: the call returns after the step whose
    allocation evicts part of the prefix the probed request would reuse, and the later
    step is not tried."""
    manager = make(capacity=3)
    run(manager, "a", list(range(8)))
    manager.free("a")  # two cached blocks, idle
    manager.add_request("b", list(range(50, 54)))
    manager.add_request("c", list(range(9)))  # would reuse a's two blocks
    manager.add_request("d", list(range(60, 64)))
    before = manager.prefill_cost("c")
    assert before == PrefillCost(2, 0, 1)
    steps = [[Slot("b", 4)], [Slot("b", 8, [1, 2, 3, 4])], [Slot("d", 4)]]
    got = manager.allocate_steps(steps, "c", stop_if_cost_changes=before)
    # step 1 takes the free block; step 2 grows b by one more, evicting a's leaf block
    assert len(got) == 2
    assert (got[0].cost, got[1].cost) == (None, PrefillCost(1, 0, 2))
    assert got[1].allocations[0].removed != []
    assert manager.num_blocks("d") == 0  # the third step was not tried
    unwatched = make(capacity=3)
    run(unwatched, "a", list(range(8)))
    unwatched.free("a")
    for name, prompt in (("b", range(50, 54)), ("c", range(9)), ("d", range(60, 64))):
        unwatched.add_request(name, list(prompt))
    assert len(unwatched.allocate_steps(steps, "c")) == 3  # without the watch: all steps


def test_a_watched_cost_that_is_already_stale_stops_after_the_first_step() -> None:
    """The watch compares with the cost as it is, not as it was last asked: a step that
    changes nothing the cost depends on still ends the call when the caller's figure
    was out of date from the start (the manager asks once before the steps)."""
    manager = make(capacity=8)
    manager.add_request("b", list(range(50, 54)))
    manager.add_request("c", list(range(9)))
    stale = PrefillCost(1, 0, 2)
    assert manager.prefill_cost("c") != stale
    got = manager.allocate_steps([[Slot("b", 1)], [Slot("b", 2)]], "c", stop_if_cost_changes=stale)
    assert len(got) == 1
    assert got[0].cost == manager.prefill_cost("c")


def test_a_step_s_updates_carry_the_probe_s_cost_after_them() -> None:
    """finish_step(updates, probe): the probed request's cost is asked after the frees,
    so a request waiting on blocks another one held sees them come back."""
    manager = make(capacity=3)
    run(manager, "a", list(range(12)))  # three blocks, all of the pool
    manager.add_request("b", list(range(12)))  # the same prompt: reuses two of them
    assert manager.prefill_cost("b") == PrefillCost(2, 2, 1)
    outcome = manager.finish_step([StepUpdate("a", [], -1, True)], "b")
    assert outcome.cost == manager.prefill_cost("b") == PrefillCost(2, 0, 1)
    assert outcome.usage.num_active == 0
    assert manager.finish_step([]).cost is None


def test_with_kv_cache_events_off_nothing_is_queued_and_all_else_is_the_same() -> None:
    """Stores, evictions, duplicates, preemption and frees on two managers, one building
    events and one not: the same state after every call, no event queued by the second,
    and its count of the events there would have been equal to the first's events."""
    loud, quiet = make(8), make(8, enable_kv_cache_events=False)
    assert loud.enable_kv_cache_events
    assert not quiet.enable_kv_cache_events
    taken: list[object] = []
    shared = list(range(100, 108))
    calls = [
        lambda m: run(m, "a", [*shared, 1, 2, 3, 4]),  # three full blocks
        lambda m: run(m, "b", [*shared, 4, 5, 6, 7, 8]),  # hits a's prefix
        lambda m: m.free("a"),
        lambda m: m.allocate_steps([[Slot("b", 13, [9])], [Slot("b", 14, [10])]]),
        lambda m: run(m, "c", list(range(200, 216))),  # evicts a's idle blocks
        lambda m: m.preempt("b"),
        lambda m: m.allocate("b", 14, cache=True),  # re-admitted: its own blocks again
        lambda m: m.free("c"),
        lambda m: m.free("b"),
    ]
    for call in calls:
        call(loud)
        call(quiet)
        assert quiet.num_pending_events == 0
        assert quiet.take_events() == []
        taken += loud.take_events()
        assert same_state(loud, quiet)
        assert quiet.stats().kv_events == loud.stats().kv_events == len(taken)
    assert loud.stats() == quiet.stats()
    assert any(isinstance(event, BlockRemoved) for event in taken)
    assert any(isinstance(event, BlockStored) for event in taken)
