"""release_many, cache_many and cache_chain: the same as one call per item, and all or
nothing."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from kvpool import (
    AlreadyCachedError,
    BlockNotReferencedError,
    InvalidArgumentError,
    InvalidHashError,
    PoolError,
    UnknownBlockError,
)
from kvpool.pool import BlockId, BlockPool


def _observe(pool: BlockPool, hashes: range) -> tuple[object, ...]:
    """Counts, every hash's visibility, then the eviction order a full reserve reveals."""
    seen = (pool.num_active(), pool.num_active_refs(), pool.num_inactive())
    hits = tuple(pool.prefix_hit(h) for h in hashes)
    outcome = pool.reserve([], pool.capacity - pool.num_active())
    assert outcome is not None
    return (*seen, hits, tuple(outcome.removed))


def _scenario(seed: int, batched: bool, chained: bool = False) -> tuple[object, ...]:
    """Random requests, cached and released either one call at a time or in batches."""
    rng = random.Random(seed)
    pool = BlockPool(24)
    tables: list[list[BlockId]] = []
    flags: list[bool] = []
    for _ in range(30):
        chain = [rng.randrange(16) for _ in range(rng.randint(1, 5))]
        hits, _ = pool.match_prefix(chain)
        outcome = pool.reserve(chain[:hits], len(chain) - hits)
        if outcome is None:
            victim = tables.pop(0) if tables else []
            if batched:
                pool.release_many(victim[::-1])
            else:
                for block_id in reversed(victim):
                    pool.release(block_id)
            continue
        table = pool.activate_prefix(outcome.reservation)
        fresh = [pool.allocate_private(outcome.reservation) for _ in chain[hits:]]
        pool.cancel(outcome.reservation)
        pairs = list(zip(fresh, chain[hits:], strict=True))
        if chained:
            flags += pool.cache_chain(fresh, chain[hits:])
        elif batched:
            flags += pool.cache_many(pairs)
        else:
            flags += [pool.cache_private(block_id, h) for block_id, h in pairs]
        tables.append(table + fresh)
    pool.check_invariants()
    return (*_observe(pool, range(16)), tuple(flags))


@pytest.mark.parametrize("seed", range(25))
def test_batches_give_the_answers_of_single_calls(seed: int) -> None:
    single = _scenario(seed, batched=False)
    assert _scenario(seed, batched=True) == single
    assert _scenario(seed, batched=True, chained=True) == single


def _pool_with_state() -> tuple[BlockPool, list[BlockId], BlockId, BlockId]:
    """Two private copies, a cached copy referenced twice (prefix [5, 5]), one idle."""
    pool = BlockPool(8)
    outcome = pool.reserve([], 4)
    assert outcome is not None
    private = [pool.allocate_private(outcome.reservation) for _ in range(2)]
    shared, _ = pool.allocate_cached(outcome.reservation, 5)
    idle, _ = pool.allocate_cached(outcome.reservation, 6)
    pool.cancel(outcome.reservation)
    pool.release(idle)
    twice = pool.reserve([5], 0)
    assert twice is not None
    assert pool.activate_prefix(twice.reservation) == [shared]
    pool.cancel(twice.reservation)
    return pool, private, shared, idle


BAD_RELEASES = [
    ("stale", lambda p, s, idle: [p[0], p[1] + (1 << 32)], UnknownBlockError),
    ("not an int", lambda p, s, idle: [p[0], "x"], UnknownBlockError),
    ("idle copy", lambda p, s, idle: [p[0], idle], BlockNotReferencedError),
    ("private twice", lambda p, s, idle: [p[0], p[0]], BlockNotReferencedError),
    ("three refs of two", lambda p, s, idle: [s, p[1], s, s], BlockNotReferencedError),
    ("not a sequence", lambda p, s, idle: 7, InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("name", "make", "error"), BAD_RELEASES, ids=[case[0] for case in BAD_RELEASES]
)
def test_a_bad_release_batch_changes_nothing(name: str, make: object, error: type) -> None:
    pool, private, shared, idle = _pool_with_state()
    reference, _, _, _ = _pool_with_state()
    with pytest.raises(error):
        pool.release_many(make(private, shared, idle))  # type: ignore[operator]
    pool.check_invariants()
    assert _observe(pool, range(8)) == _observe(reference, range(8))


def test_a_block_held_twice_is_released_twice() -> None:
    pool, private, shared, _ = _pool_with_state()
    pool.release_many([shared, *private, shared])
    assert pool.num_active_refs() == 0
    pool.check_invariants()


BAD_CACHES = [
    ("cached copy", lambda p, s: [(p[0], 1), (s, 2)], AlreadyCachedError),
    ("named twice", lambda p, s: [(p[0], 1), (p[0], 2)], AlreadyCachedError),
    ("bad hash", lambda p, s: [(p[0], 1), (p[1], -1)], InvalidHashError),
    ("float hash", lambda p, s: [(p[0], 1), (p[1], 2.0)], InvalidHashError),
    ("not a pair", lambda p, s: [(p[0], 1), (p[1],)], InvalidArgumentError),
    ("unknown id", lambda p, s: [(p[0], 1), (12345, 2)], UnknownBlockError),
    ("a string", lambda p, s: "pairs", InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("name", "make", "error"), BAD_CACHES, ids=[case[0] for case in BAD_CACHES]
)
def test_a_bad_cache_batch_changes_nothing(name: str, make: object, error: type) -> None:
    pool, private, shared, _ = _pool_with_state()
    reference, _, _, _ = _pool_with_state()
    with pytest.raises(error) as raised:
        pool.cache_many(make(private, shared))  # type: ignore[operator]
    assert isinstance(raised.value, PoolError)
    pool.check_invariants()
    assert _observe(pool, range(8)) == _observe(reference, range(8))


def _as_chain(pairs: object) -> tuple[Any, Any]:
    """A `cache_many` batch as `cache_chain`'s two sequences (a bad pair kept as it is)."""
    if not isinstance(pairs, list):
        return pairs, pairs
    return [pair[0] for pair in pairs], [pair[-1] for pair in pairs]


BAD_CHAINS = [case for case in BAD_CACHES if case[0] != "not a pair"] + [
    ("lengths differ", lambda p, s: ([p[0], p[1]], [1]), InvalidArgumentError),
    ("ids a string", lambda p, s: ("ab", [1, 2]), InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("name", "make", "error"), BAD_CHAINS, ids=[case[0] for case in BAD_CHAINS]
)
def test_a_bad_cache_chain_changes_nothing(name: str, make: object, error: type) -> None:
    pool, private, shared, _ = _pool_with_state()
    reference, _, _, _ = _pool_with_state()
    made = make(private, shared)  # type: ignore[operator]
    block_ids, hashes = cast(tuple[Any, Any], made) if isinstance(made, tuple) else _as_chain(made)
    with pytest.raises(error) as raised:
        pool.cache_chain(block_ids, hashes)
    assert isinstance(raised.value, PoolError)
    pool.check_invariants()
    assert _observe(pool, range(8)) == _observe(reference, range(8))


def test_a_release_batch_raises_what_its_first_bad_mention_is() -> None:
    """Over-releasing a copy before an unknown id reports the over-release, as releasing
    one id at a time would meet it first."""
    pool, private, _, _ = _pool_with_state()
    unknown = BlockId(12345)
    with pytest.raises(BlockNotReferencedError):
        pool.release_many([private[0], private[0], unknown])
    with pytest.raises(UnknownBlockError):
        pool.release_many([private[0], unknown, private[0]])
    pool.check_invariants()
