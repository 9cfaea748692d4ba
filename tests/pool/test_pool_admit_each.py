"""`BlockPool.admit_each` is `admit` of no chain for each count in turn, all or nothing;
`BlockPool.any_resident` is `prefix_hit` of each hash, in one call.

Two pools are built by the same random history, so their copies sit in the same slots:
an id's slot (its low 32 bits) is compared, its serial (the rest) differs per pool.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_pool_stateful import _lru_ids

from kvpool import BlockPool, CapacityError, InvalidArgumentError, InvalidHashError
from kvpool.pool import MAX_HASH

CAPACITY = 12
SLOT = (1 << 32) - 1


def _pool(seed: int) -> BlockPool:
    """A pool with a random history: cached chains (duplicates among them) held,
    released or evicted, and private blocks held."""
    rng = random.Random(seed)
    pool = BlockPool(CAPACITY)
    held: list[int] = []
    for _ in range(rng.randint(0, 30)):
        chain = [rng.randrange(10) for _ in range(rng.randint(1, 4))]
        admission = pool.admit(chain, rng.randint(0, 1))
        if admission is None:
            for block_id in held:
                pool.release(block_id)
            held.clear()
            continue
        fresh = admission.blocks[admission.cached :]
        for block_id, block_hash in zip(fresh, chain[admission.cached :], strict=False):
            pool.cache_private(block_id, block_hash)
        keep = rng.random() < 0.3
        for block_id in reversed(admission.blocks):
            if keep:
                held.append(block_id)
            else:
                pool.release(block_id)
    return pool


def _view(pool: BlockPool) -> tuple[object, ...]:
    """Everything a caller can see of the pool, and its LRU (by slot)."""
    hits = tuple(pool.prefix_hit(h) for h in range(10))
    return (
        pool.num_active(),
        pool.num_active_refs(),
        pool.num_inactive(),
        pool.reserves,
        pool.reserve_failures,
        pool.evictions,
        hits,
        [block_id & SLOT for block_id in _lru_ids(pool)],
    )


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.integers(0, 4), max_size=6))
def test_admit_each_is_admit_for_each_count_in_turn(seed: int, counts: list[int]) -> None:
    one, two = _pool(seed), _pool(seed)
    before = _view(one)
    got = one.admit_each(counts)
    admissions = []
    for count in counts:
        admission = two.admit([], count)
        if admission is None:
            break
        admissions.append(admission)
    event(f"fits: {got is not None}")
    event(f"evicts: {any(a.removed for a in admissions)}")
    if len(admissions) < len(counts):  # one did not fit: admit_each refuses them all
        assert got is None
        assert _view(one) == before
        return
    assert got is not None
    ids, removed = got
    assert removed == [a.removed for a in admissions]
    assert [i & SLOT for i in ids] == [b & SLOT for a in admissions for b in a.blocks]
    assert _view(one) == _view(two)
    one.check_invariants()
    one.release_many(ids)  # every id names a private copy holding one reference
    one.check_invariants()


@pytest.mark.parametrize(
    ("counts", "error"),
    [
        ([1, -1], InvalidArgumentError),
        ([1, 1.0], InvalidArgumentError),
        ([True], InvalidArgumentError),
        ("12", InvalidArgumentError),
        ([1, CAPACITY + 1], CapacityError),
    ],
)
def test_bad_counts_are_refused_and_change_nothing(counts: object, error: type) -> None:
    pool = _pool(7)
    before = _view(pool)
    with pytest.raises(error):
        pool.admit_each(counts)  # type: ignore[arg-type]
    assert _view(pool) == before


@pytest.mark.parametrize("seed", range(20))
def test_any_resident_is_prefix_hit_of_each(seed: int) -> None:
    pool = _pool(seed)
    rng = random.Random(seed)
    for _ in range(30):
        hashes = [rng.randrange(14) for _ in range(rng.randint(0, 5))]
        expected = any(pool.prefix_hit(h) is not None for h in hashes)
        assert pool.any_resident(hashes) is expected
        assert pool.any_resident(tuple(hashes)) is expected


def test_any_resident_refuses_a_bad_hash_read_before_a_resident_one() -> None:
    pool = _pool(3)
    resident = next(h for h in range(10) if pool.prefix_hit(h) is not None)
    with pytest.raises(InvalidHashError):
        pool.any_resident([MAX_HASH + 1, resident])
    with pytest.raises(InvalidHashError):
        pool.any_resident(["1"])
    assert pool.any_resident([resident, MAX_HASH + 1]) is True  # found before the bad one
