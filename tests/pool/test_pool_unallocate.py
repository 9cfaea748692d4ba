"""`BlockPool.unallocate` (the exact undo of an allocation) and the pool's own counters.

Each case builds the same populated pool from one recipe, then either undoes an
allocation and checks the pool is as if it had never been made, or makes a bad call and
checks it raised its typed error and changed nothing: a snapshot of every copy (id,
hash, refs, pins), the LRU order, the hash index, the reservations and the counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool import (
    BlockId,
    BlockNotReferencedError,
    BlockPool,
    BlockSharedError,
    CapacityError,
    ForeignReservationError,
    InvalidArgumentError,
    PoolError,
    PrefixNotResidentError,
    Reservation,
    ReservationClosedError,
    UnknownBlockError,
)
from kvpool.errors import ReservationExhaustedError
from kvpool.manager import KvManager

CAPACITY = 16
HASHES = (1, 2, 3, 10, 20, 30, 40, 99)


@dataclass
class Recipe:
    pool: BlockPool
    ids: dict[str, BlockId] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    other_pool: BlockPool = field(default_factory=lambda: BlockPool(4))
    other_id: int = 0
    other_reservation: Any = None


def _reserve(pool: BlockPool, prefix: list[int], fresh: int) -> Reservation:
    outcome = pool.reserve(prefix, fresh)
    assert outcome is not None
    return outcome.reservation


def build() -> Recipe:
    """Idle cached copies (1, 2, 3), an open reservation "r" that allocated a private
    copy, a new cached copy (10) and a duplicate of an idle hash (1), a second open
    reservation "s" with a pinned copy (20) and a copy referenced twice (30), a
    cancelled reservation, a released id and an evicted id."""
    pool = BlockPool(CAPACITY)
    recipe = Recipe(pool)
    ids, res = recipe.ids, recipe.reservations

    evicted = pool.admit([99])
    assert evicted is not None
    pool.cache_private(evicted.blocks[0], 99)
    pool.release(evicted.blocks[0])
    squeeze = _reserve(pool, [], CAPACITY)  # evicts 99
    pool.cancel(squeeze)
    ids["evicted"] = evicted.blocks[0]

    seed = pool.admit([1, 2, 3])
    assert seed is not None
    pool.cache_many(list(zip(seed.blocks, [1, 2, 3], strict=True)))
    pool.release_many(seed.blocks)  # root first into the LRU: 1 is evicted first
    ids["idle 1"] = seed.blocks[0]

    res["r"] = r = _reserve(pool, [], 6)
    ids["private"] = pool.allocate_private(r)
    ids["cached"], visible = pool.allocate_cached(r, 10)
    assert visible
    ids["duplicate"], visible = pool.allocate_cached(r, 1)
    assert not visible

    res["s"] = s = _reserve(pool, [], 3)
    ids["pinned"], _ = pool.allocate_cached(s, 20)
    res["pin"] = _reserve(pool, [20], 0)
    ids["shared"], _ = pool.allocate_cached(s, 30)
    sharer = pool.admit([30])
    assert sharer is not None
    assert sharer.blocks == [ids["shared"]]

    res["closed"] = closed = _reserve(pool, [], 1)
    pool.cancel(closed)

    gone = pool.admit([], 1)
    assert gone is not None
    pool.release(gone.blocks[0])
    ids["released"] = gone.blocks[0]

    other = recipe.other_pool
    recipe.other_reservation = _reserve(other, [], 2)
    recipe.other_id = other.allocate_private(recipe.other_reservation)
    pool.check_invariants()
    return recipe


def snapshot(recipe: Recipe) -> dict[str, Any]:
    """Everything observable about the recipe's pool, read without changing it."""
    pool = recipe.pool
    copies = pool.debug_copies()
    lru = pool.debug_lru()
    index = pool.debug_index()
    return {
        "counts": (pool.num_active(), pool.num_inactive(), pool.num_active_refs()),
        "counters": (pool.reserves, pool.reserve_failures, pool.evictions),
        "hits": [pool.prefix_hit(h) for h in HASHES],
        "reservations": {
            name: (len(r), r.fresh, r.prefix_len, r.closed)
            for name, r in sorted(recipe.reservations.items())
        },
        "copies": copies,
        "lru": lru,
        "index": index,
        "other": (recipe.other_pool.num_active(), len(recipe.other_reservation)),
    }


# ------------------------------------------------------------------- undone exactly


def test_unallocating_a_private_copy_gives_its_unit_back() -> None:
    recipe = build()
    pool, r = recipe.pool, recipe.reservations["r"]
    before = snapshot(recipe)
    pool.unallocate(recipe.ids["private"], r)
    after = snapshot(recipe)
    assert after["counts"] == (
        before["counts"][0],  # the copy's block is reserved again: still counted active
        before["counts"][1],
        before["counts"][2] - 1,
    )
    assert after["reservations"]["r"] == (4, 4, 0, False)
    assert before["reservations"]["r"] == (3, 3, 0, False)
    assert after["counters"] == before["counters"]
    with pytest.raises(UnknownBlockError):
        pool.release(recipe.ids["private"])
    pool.check_invariants()
    # The unit is spendable again.
    for _ in range(4):
        pool.allocate_private(r)
    with pytest.raises(ReservationExhaustedError):
        pool.allocate_private(r)


def test_unallocating_a_new_cached_copy_forgets_its_hash() -> None:
    recipe = build()
    pool, r = recipe.pool, recipe.reservations["r"]
    assert pool.prefix_hit(10) is not None
    pool.unallocate(recipe.ids["cached"], r)
    assert pool.prefix_hit(10) is None
    assert r.fresh == 4
    assert 10 not in snapshot(recipe)["index"]
    pool.check_invariants()
    _, visible = pool.allocate_cached(r, 10)
    assert visible  # 0 -> 1 again


def test_unallocating_a_duplicate_leaves_its_sibling_resident_and_findable() -> None:
    recipe = build()
    pool, r = recipe.pool, recipe.reservations["r"]
    before = snapshot(recipe)
    pool.unallocate(recipe.ids["duplicate"], r)
    after = snapshot(recipe)
    assert after["index"][1] == [recipe.ids["idle 1"]]
    assert after["hits"] == before["hits"]
    assert after["lru"] == before["lru"]  # the idle sibling keeps its LRU place
    pool.check_invariants()
    admission = pool.admit([1])
    assert admission is not None
    assert admission.blocks == [recipe.ids["idle 1"]]


def test_unallocating_the_first_copy_promotes_its_duplicate() -> None:
    recipe = build()
    pool, r = recipe.pool, recipe.reservations["r"]
    first, visible = pool.allocate_cached(r, 40)
    assert visible
    second, visible = pool.allocate_cached(r, 40)
    assert not visible
    pool.unallocate(first, r)
    assert snapshot(recipe)["index"][40] == [second]
    hit = pool.prefix_hit(40)
    assert hit is not None
    assert hit.is_active
    pool.check_invariants()
    admission = pool.admit([40])
    assert admission is not None
    assert admission.blocks == [second]


def test_unallocating_without_a_reservation_frees_the_unit() -> None:
    recipe = build()
    pool = recipe.pool
    active, inactive, refs = pool.num_active(), pool.num_inactive(), pool.num_active_refs()
    pool.unallocate(recipe.ids["private"])
    assert (pool.num_active(), pool.num_inactive(), pool.num_active_refs()) == (
        active - 1,
        inactive,
        refs - 1,
    )
    assert recipe.reservations["r"].fresh == 3
    pool.check_invariants()


def test_unallocating_into_another_open_reservation_of_this_pool() -> None:
    # The unit goes to the reservation given, whichever allocated the copy.
    recipe = build()
    pool = recipe.pool
    pool.unallocate(recipe.ids["private"], recipe.reservations["s"])
    assert (recipe.reservations["r"].fresh, recipe.reservations["s"].fresh) == (3, 2)
    pool.check_invariants()


# ------------------------------------------------------ bad input: typed, no change


@dataclass(frozen=True)
class Bad:
    call: Callable[[Recipe], object]
    error: type[PoolError]


BAD = {
    "released id": Bad(lambda c: c.pool.unallocate(c.ids["released"]), UnknownBlockError),
    "evicted id": Bad(lambda c: c.pool.unallocate(c.ids["evicted"]), UnknownBlockError),
    "other pool's id": Bad(lambda c: c.pool.unallocate(c.other_id), UnknownBlockError),
    "not an id": Bad(lambda c: c.pool.unallocate("x"), UnknownBlockError),
    "closed reservation": Bad(
        lambda c: c.pool.unallocate(c.ids["private"], c.reservations["closed"]),
        ReservationClosedError,
    ),
    "other pool's reservation": Bad(
        lambda c: c.pool.unallocate(c.ids["private"], c.other_reservation),
        ForeignReservationError,
    ),
    "not a reservation": Bad(
        lambda c: c.pool.unallocate(c.ids["private"], "r"), ForeignReservationError
    ),
    "pinned copy": Bad(
        lambda c: c.pool.unallocate(c.ids["pinned"], c.reservations["s"]), BlockSharedError
    ),
    "copy referenced twice": Bad(
        lambda c: c.pool.unallocate(c.ids["shared"], c.reservations["s"]), BlockSharedError
    ),
    "idle cached copy": Bad(lambda c: c.pool.unallocate(c.ids["idle 1"]), BlockNotReferencedError),
}


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_a_bad_unallocate_raises_its_error_and_changes_nothing(case: Bad) -> None:
    recipe = build()
    before = snapshot(recipe)
    with pytest.raises(case.error):
        case.call(recipe)
    assert snapshot(recipe) == before
    recipe.pool.check_invariants()


def test_a_copy_unallocated_twice_is_unknown_the_second_time() -> None:
    recipe = build()
    recipe.pool.unallocate(recipe.ids["cached"], recipe.reservations["r"])
    before = snapshot(recipe)
    with pytest.raises(UnknownBlockError):
        recipe.pool.unallocate(recipe.ids["cached"], recipe.reservations["r"])
    assert snapshot(recipe) == before


# ------------------------------------------------------------------------ counters


def _counters(pool: BlockPool) -> tuple[int, int, int]:
    return pool.reserves, pool.reserve_failures, pool.evictions


def test_the_pool_counts_reserves_failures_and_evicted_copies() -> None:
    pool = BlockPool(6)
    assert _counters(pool) == (0, 0, 0)
    # Three idle cached copies: hash 5 twice (a duplicate), hash 6 once.
    r = _reserve(pool, [], 3)
    assert _counters(pool) == (1, 0, 0)
    a, _ = pool.allocate_cached(r, 5)
    b, _ = pool.allocate_cached(r, 5)
    c, _ = pool.allocate_cached(r, 6)
    pool.cancel(r)
    pool.release_many([a, b, c])
    assert pool.num_inactive() == 3

    assert pool.admit([], 3) is not None  # fits in the free blocks: no eviction
    assert _counters(pool) == (2, 0, 0)
    assert pool.reserve([], 4) is None  # no free block, 3 evictable
    assert pool.admit([7], 3) is None
    assert _counters(pool) == (2, 2, 0)
    outcome = pool.reserve([], 2)  # evicts two copies: both of hash 5, one hash gone
    assert outcome is not None
    assert outcome.removed == [5]
    assert _counters(pool) == (3, 2, 2)
    admission = pool.admit([8])  # evicts the copy of 6
    assert admission is not None
    assert admission.removed == [6]
    assert _counters(pool) == (4, 2, 3)
    pool.check_invariants()


def test_refused_calls_and_undos_count_nothing() -> None:
    pool = BlockPool(4)
    r = _reserve(pool, [], 2)
    block = pool.allocate_private(r)
    before = _counters(pool)
    with pytest.raises(CapacityError):
        pool.admit([1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgumentError):
        pool.reserve([], -1)
    with pytest.raises(PrefixNotResidentError):
        pool.reserve([42], 1)
    pool.unallocate(block, r)
    pool.cancel(r)
    assert _counters(pool) == before


def test_a_managers_evictions_are_the_pools() -> None:
    pool = BlockPool(4)
    manager = KvManager(pool, 4)
    manager.add_request("a", list(range(16)))
    assert manager.allocate("a", 16) is not None
    manager.mark_computed("a", 16)
    manager.free("a")
    manager.add_request("b", list(range(100, 108)))
    assert manager.allocate("b", 8) is not None
    assert pool.evictions == 2
    assert manager.stats().evictions == pool.evictions


def test_without_prefix_caching_no_prefix_query_is_counted() -> None:
    pool = BlockPool(8)
    manager = KvManager(pool, 4, enable_prefix_caching=False)
    manager.add_request("a", list(range(12)))
    assert manager.allocate("a", 12) is not None
    manager.mark_computed("a", 12)
    manager.free("a")
    manager.add_request("b", list(range(12)))
    assert manager.allocate("b", 12) is not None
    stats = manager.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (0, 0)
    assert pool.reserves == 2
