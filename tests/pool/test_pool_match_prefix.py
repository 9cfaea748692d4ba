"""match_prefix gives the answers of a prefix_hit walk, in one call."""

from __future__ import annotations

import random

import pytest

from kvpool import InvalidArgumentError, InvalidHashError
from kvpool.pool import BlockPool


def _walk(pool: BlockPool, hashes: list[int], limit: int) -> tuple[int, int]:
    hits = active = 0
    for block_hash in hashes[:limit]:
        found = pool.prefix_hit(block_hash)
        if found is None:
            break
        hits += 1
        active += found.is_active
    return hits, active


@pytest.mark.parametrize("seed", range(20))
def test_match_prefix_equals_the_prefix_hit_walk(seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(16)
    held = []
    for _ in range(40):  # random residency: cached idle, cached active, pinned, evicted
        chain = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        outcome = pool.reserve([], len(chain))
        if outcome is None:
            for block_id in held:
                pool.release(block_id)
            held.clear()
            continue
        ids = [pool.allocate_cached(outcome.reservation, h)[0] for h in chain]
        pool.cancel(outcome.reservation)
        keep = rng.random() < 0.3
        for block_id in reversed(ids):
            if keep:
                held.append(block_id)
            else:
                pool.release(block_id)
    for _ in range(50):
        hashes = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
        limit = rng.randint(0, 9)
        assert pool.match_prefix(hashes, limit) == _walk(pool, hashes, limit)
        assert pool.match_prefix(tuple(hashes)) == _walk(pool, hashes, len(hashes))


def test_match_prefix_rejects_bad_input_before_the_first_miss() -> None:
    pool = BlockPool(2)
    outcome = pool.reserve([], 1)
    assert outcome is not None
    pool.allocate_cached(outcome.reservation, 5)
    with pytest.raises(InvalidHashError, match="'x'"):
        pool.match_prefix([5, "x"])  # type: ignore[list-item]
    with pytest.raises(InvalidHashError, match="-1"):
        pool.match_prefix([-1])
    with pytest.raises(InvalidArgumentError, match="limit"):
        pool.match_prefix([5], -1)
    with pytest.raises(InvalidArgumentError, match="prefix"):
        pool.match_prefix("55")  # type: ignore[arg-type]
    assert pool.match_prefix([5, 6, "ignored after the miss"]) == (1, 1)  # type: ignore[list-item]
    pool.check_invariants()
