"""The reference's seven tests (vllm_block_pool.rs, `mod tests`), translated one for one.

`pool.assert_lru_consistent()` becomes `pool.check_invariants()`, which performs the same
LRU walk plus the index and capacity checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool import BlockPool, InvariantViolationError, ReserveOutcome


def reserve(pool: BlockPool, prefix: Sequence[int], fresh: int) -> ReserveOutcome:
    """The reference's helper: a reserve that must not run out of capacity."""
    outcome = pool.reserve(prefix, fresh)
    assert outcome is not None, "unexpected capacity exhaustion"
    return outcome


def test_duplicate_hashes_consume_distinct_capacity_but_share_visibility() -> None:
    pool = BlockPool(2)
    first = reserve(pool, [], 1).reservation
    first_id = pool.allocate_private(first)
    assert pool.cache_private(first_id, 7)

    second = reserve(pool, [], 1).reservation
    second_id = pool.allocate_private(second)
    assert not pool.cache_private(second_id, 7)
    assert pool.num_active() == 2

    pool.release(first_id)
    pool.release(second_id)
    assert pool.num_inactive() == 2
    pool.check_invariants()


def test_prefix_pin_is_excluded_from_atomic_fresh_capacity() -> None:
    pool = BlockPool(1)
    seed = reserve(pool, [], 1).reservation
    block = pool.allocate_private(seed)
    assert pool.cache_private(block, 9)
    pool.release(block)

    assert pool.reserve([9], 1) is None
    assert pool.num_active() == 0
    assert pool.num_inactive() == 1
    pool.check_invariants()


def test_removal_is_reported_only_for_the_last_physical_copy() -> None:
    pool = BlockPool(2)
    first = reserve(pool, [], 1).reservation
    first_id = pool.allocate_private(first)
    assert pool.cache_private(first_id, 3)
    second = reserve(pool, [], 1).reservation
    second_id = pool.allocate_private(second)
    assert not pool.cache_private(second_id, 3)
    pool.release(first_id)
    pool.release(second_id)

    first_eviction = reserve(pool, [], 1)
    assert first_eviction.removed == []
    pool.cancel(first_eviction.reservation)

    second_eviction = reserve(pool, [], 2)
    assert second_eviction.removed == [3]
    pool.cancel(second_eviction.reservation)
    pool.check_invariants()


def test_canceled_prefix_evicts_leaf_before_parent_under_pressure() -> None:
    pool = BlockPool(2)
    seed = reserve(pool, [], 2).reservation
    parent = pool.allocate_private(seed)
    leaf = pool.allocate_private(seed)
    assert pool.cache_private(parent, 7)
    assert pool.cache_private(leaf, 8)

    # Match the normal request-release contract: the leaf enters the LRU before its parent.
    pool.release(leaf)
    pool.release(parent)

    canceled = reserve(pool, [7, 8], 0)
    assert canceled.removed == []
    pool.cancel(canceled.reservation)

    pressure = reserve(pool, [], 1)
    assert pressure.removed == [8]
    assert pool.prefix_hit(7) is not None
    assert pool.prefix_hit(8) is None
    pool.cancel(pressure.reservation)
    pool.check_invariants()


def test_pinning_middle_inactive_copy_preserves_lru_order() -> None:
    pool = BlockPool(3)
    seed = reserve(pool, [], 3).reservation
    first = pool.allocate_private(seed)
    middle = pool.allocate_private(seed)
    last = pool.allocate_private(seed)
    assert pool.cache_private(first, 1)
    assert pool.cache_private(middle, 2)
    assert pool.cache_private(last, 3)
    pool.release(first)
    pool.release(middle)
    pool.release(last)
    pool.check_invariants()

    pinned = reserve(pool, [2], 1)
    assert pinned.removed == [1]
    pool.check_invariants()
    pool.cancel(pinned.reservation)
    pool.check_invariants()

    pressure = reserve(pool, [], 2)
    assert pressure.removed == [3]
    pool.check_invariants()
    pool.cancel(pressure.reservation)
    pool.check_invariants()


def test_activated_prefix_reenters_inactive_lru_on_release() -> None:
    pool = BlockPool(1)
    seed = reserve(pool, [], 1).reservation
    block = pool.allocate_private(seed)
    assert pool.cache_private(block, 7)
    pool.release(block)

    activation = reserve(pool, [7], 0).reservation
    assert pool.activate_prefix(activation) == [block]
    pool.cancel(activation)
    assert pool.num_inactive() == 0
    pool.check_invariants()

    pool.release(block)
    assert pool.num_inactive() == 1
    pool.check_invariants()

    pressure = reserve(pool, [], 1)
    assert pressure.removed == [7]
    pool.cancel(pressure.reservation)
    pool.check_invariants()


def test_eviction_rejects_head_with_predecessor() -> None:
    """The reference corrupts the head's back-link and expects the pool to refuse it.

    kvpool's LRU is circular around a sentinel (``pool._lru``): the head's ``prev`` must be
    the sentinel. Pointing it at the copy itself is the reference's corruption; here the
    consistency check is what must catch it (the reference's message for this breach is
    "inactive LRU head has a predecessor"; kvpool reports it as a broken back-pointer).
    """
    pool = BlockPool(1)
    seed = reserve(pool, [], 1).reservation
    block = pool.allocate_private(seed)
    assert pool.cache_private(block, 7)
    pool.release(block)

    head = pool._lru.next  # type: ignore[attr-defined]
    assert head is not None
    assert head.id == block
    head.prev = head
    with pytest.raises(
        InvariantViolationError, match="inactive LRU contains a broken back-pointer"
    ):
        pool.check_invariants()
