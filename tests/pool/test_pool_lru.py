"""Targeted tests for the pool's O(1) paths: the intrusive LRU, pins, duplicates and ids.

The eviction order is read back through the public API only: fill the free capacity,
then reserve one block at a time and record which hashes each step removed.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Sequence

import pytest

from kvpool import BlockId, BlockPool, PrefixHit, Reservation, UnknownBlockError
from kvpool.errors import BlockNotReferencedError
from kvpool.pool import MAX_HASH

ACTIVE = PrefixHit(is_active=True)
INACTIVE = PrefixHit(is_active=False)


def reserve(pool: BlockPool, prefix: Sequence[int], fresh: int) -> Reservation:
    outcome = pool.reserve(prefix, fresh)
    assert outcome is not None, f"reserve({prefix}, {fresh}) ran out of capacity"
    assert outcome.removed == [], "this helper is for reserves that evict nothing"
    return outcome.reservation


def cached(pool: BlockPool, hashes: Sequence[int]) -> list[BlockId]:
    """New cached copies of ``hashes``, each holding one request reference."""
    reservation = reserve(pool, [], len(hashes))
    ids = [pool.allocate_cached(reservation, h)[0] for h in hashes]
    pool.cancel(reservation)
    return ids


def inactive(pool: BlockPool, hashes: Sequence[int]) -> list[BlockId]:
    """New cached copies of ``hashes``, released in order: the LRU gains them in order."""
    ids = cached(pool, hashes)
    for block in ids:
        pool.release(block)
    return ids


def evictions(pool: BlockPool) -> list[list[int]]:
    """Evict every evictable copy one at a time; what each eviction removed, in order.

    A ``[]`` step evicted a copy whose hash keeps another resident copy. The capacity
    reserved on the way is given back at the end.
    """
    free = pool.capacity - pool.num_active() - pool.num_inactive()
    fill = pool.reserve([], free)
    assert fill is not None
    assert fill.removed == []
    taken = [fill.reservation]
    steps = []
    while (outcome := pool.reserve([], 1)) is not None:
        steps.append(outcome.removed)
        taken.append(outcome.reservation)
    assert pool.num_inactive() == 0
    for reservation in taken:
        pool.cancel(reservation)
    pool.check_invariants()
    return steps


def order(pool: BlockPool) -> list[int]:
    """The hashes removed by draining the LRU, in eviction order."""
    return [h for step in evictions(pool) for h in step]


# ----------------------------------------------------------------- pinning and order


@pytest.mark.parametrize("position", range(5))
def test_pinning_any_lru_entry_keeps_the_others_in_order(position: int) -> None:
    pool = BlockPool(5)
    hashes = [1, 2, 3, 4, 5]
    inactive(pool, hashes)
    pinned = hashes[position]
    reserve(pool, [pinned], 0)
    assert pool.num_inactive() == 4
    assert pool.prefix_hit(pinned) == ACTIVE
    pool.check_invariants()
    assert order(pool) == [h for h in hashes if h != pinned]
    assert pool.prefix_hit(pinned) == ACTIVE  # a pinned copy is never evicted


@pytest.mark.parametrize("position", range(5))
def test_cancelled_pin_moves_the_entry_to_the_tail(position: int) -> None:
    pool = BlockPool(5)
    hashes = [1, 2, 3, 4, 5]
    inactive(pool, hashes)
    pinned = hashes[position]
    pool.cancel(reserve(pool, [pinned], 0))
    assert pool.num_inactive() == 5
    assert pool.prefix_hit(pinned) == INACTIVE
    assert order(pool) == [h for h in hashes if h != pinned] + [pinned]


def test_pinning_two_adjacent_entries_relinks_their_neighbours() -> None:
    pool = BlockPool(6)
    inactive(pool, [1, 2, 3, 4, 5, 6])
    first = reserve(pool, [3], 0)
    second = reserve(pool, [4], 0)
    pool.check_invariants()
    pool.cancel(second)
    pool.cancel(first)
    assert order(pool) == [1, 2, 5, 6, 4, 3]


def test_activated_prefix_returns_to_the_tail_when_released() -> None:
    pool = BlockPool(4)
    ids = inactive(pool, [1, 2, 3, 4])
    reservation = reserve(pool, [2], 0)
    assert pool.activate_prefix(reservation) == [ids[1]]
    pool.cancel(reservation)
    assert pool.num_inactive() == 3
    assert pool.prefix_hit(2) == ACTIVE
    pool.release(ids[1])
    assert order(pool) == [1, 3, 4, 2]


def test_cancel_unpins_leaf_first_behind_older_entries() -> None:
    pool = BlockPool(5)
    inactive(pool, [9])  # already in the LRU: stays older than the cancelled prefix
    inactive(pool, [3, 2, 1])  # a chain released leaf first
    pool.cancel(reserve(pool, [1, 2, 3], 1))
    assert pool.num_active() == 0
    assert order(pool) == [9, 3, 2, 1]


def test_cancel_relinks_only_copies_left_unreferenced() -> None:
    pool = BlockPool(4)
    (held,) = cached(pool, [1])  # root still used by another request
    inactive(pool, [2, 3])
    pool.cancel(reserve(pool, [1, 2, 3], 0))
    assert pool.prefix_hit(1) == ACTIVE
    assert pool.num_inactive() == 2
    pool.release(held)
    assert order(pool) == [3, 2, 1]


@pytest.mark.parametrize(("leaf_first", "expected"), [(True, [3, 2, 1]), (False, [1, 2, 3])])
def test_activated_prefix_enters_the_lru_in_release_order(
    leaf_first: bool, expected: list[int]
) -> None:
    pool = BlockPool(3)
    inactive(pool, [1, 2, 3])
    reservation = reserve(pool, [1, 2, 3], 0)
    ids = pool.activate_prefix(reservation)
    pool.cancel(reservation)
    assert pool.num_inactive() == 0
    for block in reversed(ids) if leaf_first else ids:
        pool.release(block)
    assert order(pool) == expected


def test_a_prefix_pinned_twice_needs_both_pins_gone() -> None:
    pool = BlockPool(2)
    inactive(pool, [1])
    first = reserve(pool, [1], 0)
    second = reserve(pool, [1], 0)
    pool.cancel(first)
    assert pool.prefix_hit(1) == ACTIVE
    assert pool.num_inactive() == 0
    pool.cancel(second)
    assert pool.prefix_hit(1) == INACTIVE
    assert order(pool) == [1]


def test_the_lru_empties_and_refills_around_its_sentinel() -> None:
    pool = BlockPool(2)
    inactive(pool, [1, 2])
    outcome = pool.reserve([], 2)  # evicts the whole LRU in one go
    assert outcome is not None
    assert outcome.removed == [1, 2]
    pool.cancel(outcome.reservation)
    pool.check_invariants()
    inactive(pool, [3, 4])
    assert order(pool) == [3, 4]
    inactive(pool, [5])
    assert order(pool) == [5]


# ------------------------------------------------------------------------ duplicates


def test_removed_is_reported_only_with_the_last_copy() -> None:
    pool = BlockPool(3)
    inactive(pool, [7, 8, 7])
    assert evictions(pool) == [[], [8], [7]]


def test_prefix_hit_follows_the_first_copy() -> None:
    pool = BlockPool(2)
    first, second = cached(pool, [7, 7])
    pool.release(second)
    assert pool.prefix_hit(7) == ACTIVE  # the first copy is in use
    pool.release(first)
    pool2 = BlockPool(2)
    first2, second2 = cached(pool2, [7, 7])
    pool2.release(first2)
    assert pool2.prefix_hit(7) == INACTIVE  # the second copy's use does not show
    assert pool2.num_active_refs() == 1
    pool2.release(second2)


def test_evicting_the_first_copy_promotes_the_next() -> None:
    pool = BlockPool(3)
    first, second, third = cached(pool, [7, 7, 7])
    pool.release(first)
    assert pool.prefix_hit(7) == INACTIVE
    assert evictions(pool) == [[]]  # only the first copy was evictable
    assert pool.prefix_hit(7) == ACTIVE  # the second copy is first now, and in use
    pool.release(second)
    assert pool.prefix_hit(7) == INACTIVE  # the second, not the third, took its place
    pool.release(third)
    assert evictions(pool) == [[], [7]]


def test_evicting_a_middle_copy_keeps_the_first() -> None:
    pool = BlockPool(4)
    first, second, third = cached(pool, [7, 7, 7])
    pool.release(second)
    outcome = pool.reserve([], 2)  # one free block plus the middle copy
    assert outcome is not None
    assert outcome.removed == []
    pool.cancel(outcome.reservation)
    pool.release(first)
    assert pool.prefix_hit(7) == INACTIVE  # the first copy still decides, not the third
    outcome = pool.reserve([], 3)
    assert outcome is not None
    assert outcome.removed == []  # the third copy keeps 7 resident
    assert pool.prefix_hit(7) == ACTIVE
    pool.cancel(outcome.reservation)
    pool.release(third)
    assert order(pool) == [7]


def test_a_duplicate_hash_in_a_prefix_pins_the_first_copy() -> None:
    pool = BlockPool(3)
    first, second = inactive(pool, [7, 7])
    reservation = reserve(pool, [7], 0)
    assert pool.num_inactive() == 1
    assert pool.activate_prefix(reservation) == [first]
    pool.cancel(reservation)
    assert evictions(pool) == [[]]  # the second copy went, 7 stays resident
    assert pool.prefix_hit(7) == ACTIVE
    with pytest.raises(UnknownBlockError):
        pool.release(second)
    pool.release(first)
    assert order(pool) == [7]


# --------------------------------------------------------- duplicates within a prefix


def test_a_hash_repeated_in_a_prefix_is_pinned_once_per_mention() -> None:
    pool = BlockPool(2)
    (block,) = inactive(pool, [7])
    reservation = reserve(pool, [7, 7], 0)
    assert len(reservation) == 2
    assert pool.num_inactive() == 0
    assert pool.num_active() == 1
    ids = pool.activate_prefix(reservation)
    assert ids == [block, block]
    assert pool.num_active_refs() == 2
    pool.cancel(reservation)
    pool.release(block)
    assert pool.prefix_hit(7) == ACTIVE
    pool.release(block)
    assert pool.prefix_hit(7) == INACTIVE
    assert order(pool) == [7]


def test_a_repeated_prefix_hash_counts_once_against_evictable_capacity() -> None:
    pool = BlockPool(2)
    inactive(pool, [7, 8])
    assert pool.reserve([7, 7], 2) is None  # 7 is pinned: only 8 is evictable
    outcome = pool.reserve([7, 7], 1)
    assert outcome is not None
    assert outcome.removed == [8]
    pool.cancel(outcome.reservation)
    pool.check_invariants()
    assert order(pool) == [7]


# ------------------------------------------------------------------ a refused reserve


@pytest.mark.parametrize(
    ("prefix", "fresh"),
    [([], 4), ([2], 3), ([1, 2], 1), ([2, 2], 3), ([4, 1], 2), ([4], 3), ([1, 2, 4], 1)],
)
def test_a_refused_reserve_changes_nothing(prefix: list[int], fresh: int) -> None:
    def build() -> BlockPool:
        pool = BlockPool(3)
        inactive(pool, [1, 2])
        cached(pool, [4])  # active, so pinning it frees nothing
        return pool

    pool, control = build(), build()
    assert pool.reserve(prefix, fresh) is None
    pool.check_invariants()
    for h in (1, 2, 4):
        assert pool.prefix_hit(h) == control.prefix_hit(h)
    counts = (pool.num_active(), pool.num_active_refs(), pool.num_inactive())
    assert counts == (control.num_active(), control.num_active_refs(), control.num_inactive())
    assert evictions(pool) == evictions(control) == [[1], [2]]


# -------------------------------------------------------------------------- block ids


def test_block_ids_are_never_reused() -> None:
    pool = BlockPool(2)
    seen: set[BlockId] = set()
    for step in range(10_000):  # crosses several of the pool's id ranges
        if step % 2:
            (block,) = cached(pool, [step % 3])
            pool.release(block)  # inactive; evicted by a later reserve
        else:
            outcome = pool.reserve([], 1)
            assert outcome is not None
            block = pool.allocate_private(outcome.reservation)
            pool.release(block)
        assert block not in seen
        seen.add(block)
    evictions(pool)  # now every id ever handed out is stale
    for stale in sorted(seen)[::97]:
        with pytest.raises(UnknownBlockError):
            pool.release(stale)
        with pytest.raises(UnknownBlockError):
            pool.cache_private(stale, 1)
    assert (pool.num_active(), pool.num_active_refs(), pool.num_inactive()) == (0, 0, 0)
    pool.check_invariants()


def test_block_ids_are_distinct_across_pools() -> None:
    pools = [BlockPool(3) for _ in range(3)]
    ids: list[set[BlockId]] = [set() for _ in pools]
    for _ in range(5_000):
        for pool, mine in zip(pools, ids, strict=True):
            reservation = pool.reserve([], 1)
            assert reservation is not None
            block = pool.allocate_private(reservation.reservation)
            mine.add(block)
            pool.release(block)
    assert sum(map(len, ids)) == len(set().union(*ids)) == 15_000


def test_an_id_from_another_pool_names_nothing_here() -> None:
    here, there = BlockPool(4), BlockPool(4)
    local = cached(here, [1, 2])
    foreign = cached(there, [1, 2])  # same slots, same hashes, different pool
    for block in foreign:
        with pytest.raises(UnknownBlockError):
            here.release(block)
        with pytest.raises(UnknownBlockError):
            here.cache_private(block, 5)
    assert here.num_active_refs() == 2
    assert here.prefix_hit(1) == ACTIVE
    for block in local:
        here.release(block)
    for block in foreign:
        there.release(block)
    here.check_invariants()
    there.check_invariants()


# ------------------------------------------------------------- allocate_cached flags


def test_allocate_cached_reports_visibility_from_zero_to_one() -> None:
    pool = BlockPool(3)
    reservation = reserve(pool, [], 3)
    first, visible = pool.allocate_cached(reservation, MAX_HASH)
    assert visible
    second, visible = pool.allocate_cached(reservation, MAX_HASH)
    assert not visible
    private = pool.allocate_private(reservation)
    assert not pool.cache_private(private, MAX_HASH)
    pool.cancel(reservation)
    for block in (first, second, private):
        pool.release(block)
    assert evictions(pool) == [[], [], [MAX_HASH]]
    reservation = reserve(pool, [], 2)
    block, visible = pool.allocate_cached(reservation, MAX_HASH)
    assert visible  # every copy was evicted: visible again
    pool.release(block)
    _, visible = pool.allocate_cached(reservation, MAX_HASH)
    assert not visible  # an inactive copy still counts as resident


def test_cache_private_after_an_allocate_cached_is_not_visible_again() -> None:
    pool = BlockPool(2)
    reservation = reserve(pool, [], 2)
    private = pool.allocate_private(reservation)
    _, visible = pool.allocate_cached(reservation, 0)
    assert visible
    assert not pool.cache_private(private, 0)
    assert pool.prefix_hit(0) == ACTIVE
    pool.check_invariants()


# --------------------------------------------------------------------------- memory


def _churn(pool: BlockPool, rounds: int, width: int) -> None:
    """Each round evicts ``width`` copies with one reserve and caches ``width`` more."""
    for _ in range(rounds):
        outcome = pool.reserve([], width)
        assert outcome is not None
        ids = [pool.allocate_cached(outcome.reservation, h)[0] for h in range(width)]
        pool.cancel(outcome.reservation)
        for block in ids:
            pool.release(block)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_evicted_copies_are_freed_without_the_cycle_collector(width: int) -> None:
    """Evicted copies are unlinked from each other, so reference counting frees them at
    once: churning the cache makes no cyclic garbage (and no collector pauses)."""
    pool = BlockPool(width)
    _churn(pool, 200, width)
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _churn(pool, 2_000, width)
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    # A retained copy costs >= 56 bytes: 2,000 rounds would keep >= 112,000 * width bytes.
    assert growth < 32_000, f"{growth} bytes retained after churning {2_000 * width} copies"


def test_a_dropped_pool_is_freed() -> None:
    """A pool dropped with copies in its LRU, a pinned copy and an open reservation
    leaves nothing behind once the cycle collector has run."""

    def one_pool() -> None:
        pool = BlockPool(8)
        inactive(pool, range(8))
        reserve(pool, [3], 0)

    for _ in range(50):
        one_pool()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1_000):
            one_pool()
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert growth < 32_000, f"{growth} bytes retained by 1,000 dropped pools"


# ------------------------------------------------- undoing a call keeps the LRU order


def _lru_order(pool: BlockPool) -> list[int]:
    """The idle hashes, oldest first (found by evicting them all)."""
    removed: list[int] = []
    outcome = pool.reserve([], pool.capacity)
    assert outcome is not None
    removed = list(outcome.removed)
    pool.cancel(outcome.reservation)
    return removed


def _seeded() -> BlockPool:
    """Idle copies 3, 2, 1 (a chain freed leaf first), then 10, 11 (oldest first)."""
    pool = BlockPool(8)
    for chain in ([1, 2, 3], [10], [11]):
        admission = pool.admit(chain)
        assert admission is not None
        pool.cache_many(list(zip(admission.blocks, chain, strict=True)))
        pool.release_many(admission.blocks[::-1])
    return pool


def test_seeded_lru_order() -> None:
    assert _lru_order(_seeded()) == [3, 2, 1, 10, 11]


def test_unreserve_puts_idle_prefix_copies_back_in_place() -> None:
    pool = _seeded()
    outcome = pool.reserve([1, 2], 1)
    assert outcome is not None
    pool.unreserve(outcome.reservation)
    pool.check_invariants()
    assert _lru_order(pool) == [3, 2, 1, 10, 11]
    # A plain cancel is a use: the prefix re-enters at the tail, leaf first.
    pool = _seeded()
    outcome = pool.reserve([1, 2], 1)
    assert outcome is not None
    pool.cancel(outcome.reservation)
    assert _lru_order(pool) == [3, 10, 11, 2, 1]


def test_unadmit_puts_idle_prefix_copies_back_in_place() -> None:
    pool = _seeded()
    admission = pool.admit([1, 2, 3, 4], 1)
    assert admission is not None
    assert admission.cached == 3
    pool.unadmit(admission.blocks[::-1])
    pool.check_invariants()
    assert _lru_order(pool) == [3, 2, 1, 10, 11]
    assert (pool.num_active(), pool.num_active_refs()) == (0, 0)


def test_unadmit_of_a_copy_another_request_released_meanwhile() -> None:
    # "10" is held by another request when the admit reuses it; that request lets go
    # before the undo: without the admit, 10 would have gone idle then, so there it goes.
    pool = _seeded()
    other = pool.admit([10])
    assert other is not None
    admission = pool.admit([10])
    assert admission is not None
    pool.release_many(other.blocks)
    more = pool.admit([11])
    assert more is not None
    pool.release_many(more.blocks)  # 11 goes idle after 10 would have
    pool.unadmit(admission.blocks)
    pool.check_invariants()
    assert _lru_order(pool) == [3, 2, 1, 10, 11]


def test_unadmit_refuses_a_bad_id_and_changes_nothing() -> None:
    pool = _seeded()
    admission = pool.admit([1, 2])
    assert admission is not None
    with pytest.raises(BlockNotReferencedError):
        pool.unadmit([admission.blocks[1], admission.blocks[1]])
    pool.unadmit(admission.blocks[::-1])
    assert _lru_order(pool) == [3, 2, 1, 10, 11]
