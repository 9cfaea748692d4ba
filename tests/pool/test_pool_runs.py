"""The pool's range forms (``*_runs``) are its per-block calls, with runs in and out.

Two pools are built by the same random history (chains of run-key-like hashes, some
longer than a bucket, token-hash-sized ones, duplicates; tables held, released,
evicted), so their copies get ids equal in the low 32 bits; one then makes a per-block
call and the other its range form, and everything a caller can see of the two must be
the same: answers, counters, copies, the LRU and the index (ids by their low 32 bits).
The histories run twice: with small ids, and with ids past ``2**62`` (no machine word to
compiled code), which take other paths.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import BlockPool, InvalidArgumentError, InvalidHashError, UnknownBlockError
from kvpool.pool import MAX_HASH
from kvpool.pool.runs import (
    descents_of,
    expand,
    expand_descents,
    overlapping,
    run_at,
    runs_length,
    runs_of,
    slice_runs,
    truncate_runs,
)

CAPACITY = 40
LOW = (1 << 32) - 1
BIG = 1 << 62  # the first hash (or id) that is no machine word


def _chain(rng: random.Random) -> list[int]:
    """A request's chain: a few runs of consecutive hashes (a trace block's blocks, one
    sometimes crossing a bucket's end), or token-hash-sized hashes, or both."""
    chain: list[int] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6:
            base = rng.randrange(6) * 64 + rng.choice((0, 0, 60))
            chain.extend(range(base, base + rng.randint(1, 8)))
        elif kind < 0.8:
            chain.append(BIG + rng.randrange(4))  # big, and repeated across chains
        else:
            chain.append(rng.randrange(400))  # anything: duplicates of other runs
    return chain


def _history(pool: BlockPool, seed: int) -> list[list[int]]:
    """A random history on ``pool``; returns the tables still held (ids, root first)."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    for _ in range(rng.randint(0, 25)):
        chain = _chain(rng)
        admission = pool.admit(chain, rng.randint(0, 2))
        if admission is None:
            while held:
                pool.release_many(held.pop()[::-1])
            continue
        fresh = admission.blocks[admission.cached :]
        pool.cache_chain(fresh[: len(chain) - admission.cached], chain[admission.cached :])
        if rng.random() < 0.4:
            held.append(list(admission.blocks))
        else:
            pool.release_many(admission.blocks[::-1])
    return held


def _view(pool: BlockPool) -> tuple[object, ...]:
    """Everything a caller can see of the pool, ids by their low 32 bits."""
    return (
        pool.num_active(),
        pool.num_active_refs(),
        pool.num_inactive(),
        pool.reserves,
        pool.reserve_failures,
        pool.evictions,
        [(i & LOW, *rest) for i, *rest in pool.debug_copies()],
        [i & LOW for i in pool.debug_lru()],
        {h: [i & LOW for i in ids] for h, ids in pool.debug_index().items()},
    )


def _twins(seed: int) -> tuple[BlockPool, BlockPool, list[list[int]], list[list[int]]]:
    one, two = BlockPool(CAPACITY), BlockPool(CAPACITY)
    return one, two, _history(one, seed), _history(two, seed)


@pytest.fixture(params=["small ids", "big ids"], scope="module")
def ids(request: pytest.FixtureRequest) -> str:
    """Pools made after enough others take ids past 2**62 (each pool claims its own
    range of serials from one process-wide counter)."""
    if request.param == "big ids":
        _push_ids_past(BIG)
    return str(request.param)


def _push_ids_past(limit: int) -> None:
    """Create pools until a fresh pool's first id is past ``limit`` (a pool that
    allocates claims a range of serials)."""
    while True:
        pool = BlockPool(1)
        outcome = pool.reserve([], 1)
        assert outcome is not None
        if pool.allocate_private(outcome.reservation) > limit:
            return


SEEDS = st.integers(0, 2**32)


def _flags(firsts: list[int], count: int) -> list[bool]:
    """A range form's first-copy positions (runs) as a per-block call's flags."""
    positions = set(expand(firsts))
    assert all(0 <= p < count for p in positions)
    return [p in positions for p in range(count)]


def _same(
    seed: int,
    per_block: Callable[[BlockPool, list[list[int]]], object],
    runs: Callable[[BlockPool, list[list[int]]], object],
) -> None:
    """``per_block`` on one twin and ``runs`` on the other give equal answers (or raise
    the same error) and leave equal pools."""
    one, two, held_one, held_two = _twins(seed)
    outcomes = []
    for pool, call, held in ((one, per_block, held_one), (two, runs, held_two)):
        try:
            outcomes.append(("ok", call(pool, held)))
        except Exception as exc:  # the two must raise alike
            outcomes.append(("raised", type(exc)))
    assert outcomes[0] == outcomes[1]
    assert _view(one) == _view(two)
    one.check_invariants()
    two.check_invariants()


@settings(max_examples=150, deadline=None)
@given(SEEDS, st.integers(0, 2**32))
def test_match_runs_is_match_prefix(ids: str, seed: int, pick: int) -> None:
    rng = random.Random(pick)
    chain = _chain(rng)
    limit = rng.choice((None, rng.randint(0, len(chain))))
    _same(
        seed,
        lambda pool, _: pool.match_prefix(chain, limit),
        lambda pool, _: pool.match_runs(runs_of(chain), limit),
    )


@settings(max_examples=150, deadline=None)
@given(SEEDS, st.integers(0, 2**32))
def test_any_resident_runs_is_any_resident(ids: str, seed: int, pick: int) -> None:
    chain = _chain(random.Random(pick))
    _same(
        seed,
        lambda pool, _: pool.any_resident(chain),
        lambda pool, _: pool.any_resident_runs(runs_of(chain)),
    )


@settings(max_examples=200, deadline=None)
@given(SEEDS, st.integers(0, 2**32))
def test_admit_runs_is_admit(ids: str, seed: int, pick: int) -> None:
    rng = random.Random(pick)
    chain = _chain(rng)
    blocks = rng.randint(0, len(chain) + 2)
    limit = rng.choice((None, rng.randint(0, len(chain))))
    cache = rng.randint(0, min(len(chain), blocks))

    def per_block(pool: BlockPool, _: object) -> object:
        admission = pool.admit(chain, blocks=blocks, limit=limit, cache=cache)
        if admission is None:
            return None
        blocks_low = [b & LOW for b in admission.blocks]
        return (
            blocks_low,
            admission.cached,
            admission.active_cached,
            admission.removed,
            admission.stored,
        )

    def ranged(pool: BlockPool, _: object) -> object:
        admission = pool.admit_runs(runs_of(chain), blocks=blocks, limit=limit, cache=cache)
        if admission is None:
            return None
        blocks_low = [b & LOW for b in expand(admission.ids)]
        return (
            blocks_low,
            admission.cached,
            admission.active_cached,
            expand_descents(admission.removed),
            _flags(admission.stored, max(cache - admission.cached, 0)),
        )

    _same(seed, per_block, ranged)


@settings(max_examples=200, deadline=None)
@given(SEEDS, st.integers(0, 2**32))
def test_cache_runs_is_cache_chain(ids: str, seed: int, pick: int) -> None:
    rng = random.Random(pick)
    chain = _chain(rng)

    def private(pool: BlockPool) -> list[int] | None:
        admission = pool.admit([], len(chain))
        return None if admission is None else list(admission.blocks)

    def per_block(pool: BlockPool, _: object) -> object:
        fresh = private(pool)
        return None if fresh is None else pool.cache_chain(fresh, chain)

    def ranged(pool: BlockPool, _: object) -> object:
        fresh = private(pool)
        if fresh is None:
            return None
        return _flags(pool.cache_runs(runs_of(fresh), runs_of(chain)), len(chain))

    _same(seed, per_block, ranged)


@settings(max_examples=200, deadline=None)
@given(SEEDS)
def test_release_runs_is_release_many_leaf_first(ids: str, seed: int) -> None:
    def per_block(pool: BlockPool, held: list[list[int]]) -> object:
        for table in held:
            pool.release_many(table[::-1])
        return len(held)

    def ranged(pool: BlockPool, held: list[list[int]]) -> object:
        for table in held:
            pool.release_runs(runs_of(table))
        return len(held)

    _same(seed, per_block, ranged)


@settings(max_examples=200, deadline=None)
@given(SEEDS)
def test_unadmit_runs_is_unadmit_leaf_first(ids: str, seed: int) -> None:
    def per_block(pool: BlockPool, held: list[list[int]]) -> object:
        for table in held:
            pool.unadmit(table[::-1])
        return len(held)

    def ranged(pool: BlockPool, held: list[list[int]]) -> object:
        for table in held:
            pool.unadmit_runs(runs_of(table))
        return len(held)

    _same(seed, per_block, ranged)


@settings(max_examples=200, deadline=None)
@given(SEEDS, st.lists(st.integers(0, 3), max_size=6))
def test_admit_each_after_a_table_changes_only_ids(ids: str, seed: int, counts: list[int]) -> None:
    """The hint places ids, nothing else: what a caller sees but ids is the same, and
    each admission's blocks follow its table's last block when that page has room."""
    one, two, _, held = _twins(seed)
    tails = [held[i % len(held)][-1] if held else -1 for i in range(len(counts))]
    plain = one.admit_each(counts)
    hinted = two.admit_each(counts, tails)
    assert (plain is None) == (hinted is None)
    if plain is None or hinted is None:
        return
    assert plain[1] == hinted[1]  # the same evictions
    assert len(plain[0]) == len(hinted[0])
    for pool in (one, two):
        pool.check_invariants()
    strip = _view(one)[:6], _view(two)[:6]
    assert strip[0] == strip[1]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda p: p.match_runs([1]), InvalidArgumentError),  # not pairs
        (lambda p: p.match_runs((1, 1)), InvalidArgumentError),  # not a list
        (lambda p: p.match_runs([1, -1]), InvalidArgumentError),
        (lambda p: p.match_runs(["1", 1]), InvalidArgumentError),
        (lambda p: p.match_runs([-1, 1]), InvalidHashError),
        (lambda p: p.match_runs([MAX_HASH + 1, 1]), InvalidHashError),
        (lambda p: p.any_resident_runs([MAX_HASH, 2]), InvalidHashError),  # past 2**64 - 1
        (lambda p: p.any_resident_runs([MAX_HASH + 1, 1]), InvalidHashError),
        (lambda p: p.admit_runs([1, 2], blocks=None), InvalidArgumentError),
        (lambda p: p.admit_runs([1, 2], blocks=2, after=1.5), InvalidArgumentError),
        (lambda p: p.admit_runs([1, 2], blocks=2, cache=3), InvalidArgumentError),
        (lambda p: p.cache_runs([1, 2], [5, 1]), InvalidArgumentError),  # lengths differ
        (lambda p: p.cache_runs([1, 1], [5, 1]), UnknownBlockError),
        (lambda p: p.release_runs([1, 1]), UnknownBlockError),
        (lambda p: p.unadmit_runs([7, 1, 9]), InvalidArgumentError),
        (lambda p: p.admit_each([1], [1, 2]), InvalidArgumentError),  # one hint per count
    ],
)
def test_bad_runs_are_refused_and_change_nothing(
    call: Callable[[BlockPool], object], error: type[Exception]
) -> None:
    pool = BlockPool(CAPACITY)
    _history(pool, 11)
    before = _view(pool)
    with pytest.raises(error):
        call(pool)
    assert _view(pool) == before


def test_a_table_named_twice_releases_twice_or_is_refused() -> None:
    pool = BlockPool(4)
    admission = pool.admit([1, 2])
    assert admission is not None
    table = runs_of(list(admission.blocks))
    before = _view(pool)
    with pytest.raises(Exception, match="released 2 times"):
        pool.release_runs(table + table)  # each block holds one reference
    assert _view(pool) == before
    pool.cache_chain(admission.blocks, [1, 2])
    again = pool.admit([1, 2])  # both hit: two references each
    assert again is not None
    assert again.cached == 2
    pool.release_runs(table + table)
    assert pool.num_active() == 0
    pool.check_invariants()


# ------------------------------------------------------------------ run helpers


CONSECUTIVE = st.lists(
    st.tuples(st.integers(0, 2**64) | st.integers(BIG - 3, BIG + 3), st.integers(1, 4)),
    max_size=10,
).map(lambda pieces: [first + i for first, n in pieces for i in range(n)])
"""Ints in runs of consecutive ones (some crossing ``2**62``), or lone ones."""


@settings(max_examples=300, deadline=None)
@given(CONSECUTIVE, st.integers(0, 35), st.integers(0, 35))
def test_run_helpers_agree_with_lists(items: list[int], start: int, stop: int) -> None:
    runs = runs_of(items)
    assert expand(runs) == items
    assert runs_length(runs) == len(items)
    for position, item in enumerate(items):
        assert run_at(runs, position) == item
        assert run_at(runs, position, len(items)) == item  # found from the end
    assert expand(slice_runs(runs, start, stop)) == items[start:stop]
    assert expand(slice_runs(runs, start, stop, len(items))) == items[start:stop]  # from the end
    kept = list(runs)
    truncate_runs(kept, min(start, len(items)))
    assert expand(kept) == items[: min(start, len(items))]
    assert expand_descents(descents_of(items)) == items
    assert overlapping(runs) == (len(set(items)) != len(items))


@settings(max_examples=200, deadline=None)
@given(SEEDS, st.lists(st.integers(0, 3), max_size=6))
def test_admit_each_runs_is_admit_each(ids: str, seed: int, counts: list[int]) -> None:
    def per_block(pool: BlockPool, held: list[list[int]]) -> object:
        tails = [held[i % len(held)][-1] if held else -1 for i in range(len(counts))]
        got = pool.admit_each(counts, tails)
        if got is None:
            return None
        return [i & LOW for i in got[0]], [h for hs in got[1] for h in hs]

    def ranged(pool: BlockPool, held: list[list[int]]) -> object:
        tails = [held[i % len(held)][-1] if held else -1 for i in range(len(counts))]
        got = pool.admit_each_runs(counts, tails)
        return None if got is None else ([i & LOW for i in expand(got[0])], expand_descents(got[1]))

    _same(seed, per_block, ranged)
