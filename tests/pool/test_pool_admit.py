"""BlockPool.admit against the public calls it stands for.

``admit(chain, extra)`` must have exactly the effect and result of `compose` below
(match_prefix, reserve of the hits plus the rest, activate_prefix, one allocate_private per
fresh unit, cancel), except that it validates the whole chain, ``extra`` and the capacity
first. Block ids are opaque, so two pools are compared by structure: the i-th block of one
admission stands for the i-th block of the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from state_coverage import run_until_covered
from test_pool_bad_input import ABSENT, EVICTED, Recipe, build, snapshot
from test_pool_stateful import _lru_ids

from kvpool import (
    BlockId,
    BlockPool,
    CapacityError,
    InvalidArgumentError,
    InvalidHashError,
    Reservation,
)
from kvpool.pool import MAX_HASH, Admission


def compose(pool: BlockPool, chain: Sequence[int], extra: int = 0) -> Admission | None:
    """admit's contract, spelled with the public calls it replaces."""
    hits, active = pool.match_prefix(chain)
    outcome = pool.reserve(chain[:hits], len(chain) - hits + extra)
    if outcome is None:
        return None
    r = outcome.reservation
    blocks: list[int] = [*pool.activate_prefix(r)]
    blocks += [pool.allocate_private(r) for _ in range(r.fresh)]
    pool.cancel(r)
    return Admission(blocks, hits, active, outcome.removed)


def _cached_pool(capacity: int, hashes: Sequence[int]) -> tuple[BlockPool, list[BlockId]]:
    """A pool holding one idle cached copy per hash, released in order (LRU head first)."""
    pool = BlockPool(capacity)
    outcome = pool.reserve([], len(hashes))
    assert outcome is not None
    ids = [pool.allocate_cached(outcome.reservation, h)[0] for h in hashes]
    pool.cancel(outcome.reservation)
    pool.release_many(ids)
    return pool, ids


def _ids(blocks: list[int]) -> list[BlockId]:
    """An admission's blocks, typed as the ids release_many takes."""
    return [BlockId(b) for b in blocks]


def _counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_active(), pool.num_active_refs(), pool.num_inactive()


def _hits(pool: BlockPool, hashes: Iterable[int]) -> list[bool | None]:
    return [None if (hit := pool.prefix_hit(h)) is None else hit.is_active for h in hashes]


# ------------------------------------------------- equivalence: admit vs the composition

HASHES = (*range(9), MAX_HASH)  # a small alphabet: many hits and duplicates
BAD_HASHES = (-1, 2**64, 1.5, 1.0, True, "x", None)
NEVER_CACHED = 1000  # a valid hash outside the alphabet: always a miss
COVERAGE: Counter[str] = Counter()


@dataclass
class Request:
    """One admission held in both pools: twin ids, and which are still private."""

    chain: list[int]
    a: list[BlockId]
    b: list[BlockId]
    private: list[int] = field(default_factory=list)  # indexes into a / b


@dataclass
class Pin:
    """One open reservation held in both pools, and the hashes it pins."""

    a: Reservation
    b: Reservation
    prefix: list[int]


class AdmitMachine(RuleBasedStateMachine):
    """Pool ``a`` admits, pool ``b`` composes; every other call goes to both alike."""

    def __init__(self) -> None:
        super().__init__()
        self.a: BlockPool
        self.b: BlockPool
        self.twin: dict[int, int] = {}  # id in a -> the id of the same block in b
        self.requests: list[Request] = []
        self.pins: list[Pin] = []

    @initialize(capacity=st.integers(1, 8))
    def start(self, capacity: int) -> None:
        self.a = BlockPool(capacity)
        self.b = BlockPool(capacity)

    def _resident(self) -> list[int]:
        return [h for h in HASHES if self.b.prefix_hit(h) is not None]

    def _chain(self, data: st.DataObject, size: int) -> list[int]:
        """Mostly resident hashes (so prefixes hit, with duplicates), some misses; often
        rooted at a pinned or an idle resident hash."""
        resident = self._resident()
        chain: list[int] = []
        for _ in range(size):
            use_resident = bool(resident) and data.draw(st.booleans())
            chain.append(data.draw(st.sampled_from(resident if use_resident else HASHES)))
        pinned = [h for pin in self.pins for h in pin.prefix]
        idle = [
            h for h, active in zip(resident, _hits(self.b, resident), strict=True) if not active
        ]
        roll = data.draw(st.integers(0, 3))  # root: pinned, idle, or as drawn
        roots = pinned if roll < 2 and pinned else idle if roll < 3 else []
        if chain and roots:
            chain[0] = data.draw(st.sampled_from(roots))
        return chain

    def _classify(self, chain: list[int], extra: int) -> None:
        """Count which kind of chain this is, from the state before the call."""
        hits, active = self.b.match_prefix(chain)
        pinned = {h for pin in self.pins for h in pin.prefix}
        COVERAGE["full_hit"] += 0 < hits == len(chain)
        COVERAGE["partial_hit"] += 0 < hits < len(chain)
        COVERAGE["resident_after_miss"] += any(
            self.b.prefix_hit(h) is not None for h in chain[hits + 1 :]
        )
        COVERAGE["duplicate_hit"] += len(set(chain[:hits])) < hits
        COVERAGE["prefix_active"] += active > 0
        COVERAGE["prefix_inactive"] += hits > active
        COVERAGE["prefix_pinned"] += bool(pinned.intersection(chain[:hits]))
        COVERAGE["extra"] += extra > 0

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """admit on a, the composition on b: same refusal, flags, evictions and blocks;
        a chain too long for the pool, or with a bad hash anywhere, must leave a as is."""
        capacity = self.a.capacity
        if not data.draw(st.integers(0, 2)):
            self._warm(data)
        if not self.pins:  # whichever rules run, chains meet pinned copies
            self._pin(data, 0)
        extra = data.draw(st.sampled_from((0, 0, 1, 2)))
        chain = self._chain(data, data.draw(st.integers(0, capacity)))
        if len(chain) + extra > capacity:
            with pytest.raises(CapacityError):
                self.a.admit(chain, extra)
            COVERAGE["capacity_error"] += 1
            return  # b is untouched: the invariant proves a unchanged too
        if chain and not data.draw(st.integers(0, 5)):
            bad: list[object] = list(chain)
            past_a_miss = len(chain) > 1 and data.draw(st.booleans())
            where = data.draw(st.integers(int(past_a_miss), len(chain) - 1))
            after_miss = self.b.match_prefix(chain)[0] < where  # the walk stops before it
            if past_a_miss and not after_miss:
                bad[data.draw(st.integers(0, where - 1))] = NEVER_CACHED
                after_miss = True
            bad[where] = data.draw(st.sampled_from(BAD_HASHES))
            with pytest.raises(InvalidHashError):
                self.a.admit(bad, extra)  # type: ignore[arg-type]
            COVERAGE["bad_hash"] += 1
            COVERAGE["bad_hash_after_miss"] += after_miss
            return
        self._classify(chain, extra)
        held_before = self.a.num_active() + self.a.num_inactive()  # copies + reserved
        got = self.a.admit(chain, extra)
        want = compose(self.b, chain, extra)
        assert (got is None) == (want is None), f"admit {got} vs composition {want}"
        if got is None or want is None:
            COVERAGE["none"] += 1
            return
        assert (got.cached, got.active_cached, got.removed) == (
            want.cached,
            want.active_cached,
            want.removed,
        )
        assert len(got.blocks) == len(want.blocks) == len(chain) + extra
        for a_id, b_id in zip(got.blocks[: got.cached], want.blocks[: want.cached], strict=True):
            assert self.twin[a_id] == b_id, "a cached block is not the twin's copy"
        for a_id, b_id in zip(got.blocks[got.cached :], want.blocks[want.cached :], strict=True):
            assert a_id not in self.twin, f"block id {a_id} was reused"
            self.twin[a_id] = b_id
        fresh = len(got.blocks) - got.cached
        evicted = held_before + fresh - self.a.num_active() - self.a.num_inactive()
        COVERAGE["removed_hash"] += bool(got.removed)
        COVERAGE["evicted_copy_keeping_hash"] += evicted > len(got.removed)
        COVERAGE["evicted_with_idle_hits"] += evicted > 0 and got.cached > got.active_cached
        request = Request(chain, _ids(got.blocks), _ids(want.blocks))
        request.private = list(range(got.cached, len(got.blocks)))
        self.requests.append(request)
        if data.draw(st.booleans()):
            self._cache(data, request)
        if data.draw(st.booleans()):  # a short request: done at once, its cache stays idle
            self._free(len(self.requests) - 1)
        elif len(self.requests) > 2:  # the oldest request finishes: the pool does not jam
            self._free(0)

    def _cache(self, data: st.DataObject, request: Request) -> None:
        """Cache some private blocks of ``request`` in both pools, by cache_many or by
        cache_private: under their chain hash (as an engine would) or any small hash."""
        pairs = [
            (
                i,
                request.chain[i]
                if i < len(request.chain) and data.draw(st.booleans())
                else data.draw(st.sampled_from(HASHES)),
            )
            for i in request.private
            if data.draw(st.booleans())
        ]
        if data.draw(st.booleans()):
            flags_a = self.a.cache_many([(request.a[i], h) for i, h in pairs])
            flags_b = self.b.cache_many([(request.b[i], h) for i, h in pairs])
            COVERAGE["cache_many"] += 1
        else:
            flags_a = [self.a.cache_private(request.a[i], h) for i, h in pairs]
            flags_b = [self.b.cache_private(request.b[i], h) for i, h in pairs]
            COVERAGE["cache_private"] += 1
        assert flags_a == flags_b
        chosen = {i for i, _ in pairs}
        request.private = [i for i in request.private if i not in chosen]

    @precondition(lambda self: any(r.private for r in self.requests))
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        requests = [r for r in self.requests if r.private]
        self._cache(data, data.draw(st.sampled_from(requests)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._free(data.draw(st.integers(0, len(self.requests) - 1)))

    def _free(self, index: int) -> None:
        """Release a whole request leaf first in both pools."""
        request = self.requests.pop(index)
        self.a.release_many(request.a[::-1])
        self.b.release_many(request.b[::-1])
        COVERAGE["free"] += 1

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self._pin(data, data.draw(st.integers(0, 1)))

    def _pin(self, data: st.DataObject, fresh: int) -> None:
        """Reserve a resident prefix plus ``fresh`` blocks in both pools and keep it open,
        so that later chains meet pinned copies and a fuller pool."""
        resident = self._resident()
        prefix = (
            data.draw(st.lists(st.sampled_from(resident), min_size=1, max_size=2))
            if resident
            else []
        )
        got = self.a.reserve(prefix, fresh)
        want = self.b.reserve(prefix, fresh)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert got.removed == want.removed
            self.pins.append(Pin(got.reservation, want.reservation, prefix))

    def _warm(self, data: st.DataObject) -> None:
        """Fill free capacity with idle cached copies (allocate_cached, then release) in
        both pools, so that the next admission has to evict."""
        free = self.b.capacity - self.b.num_active() - self.b.num_inactive()
        few = st.sampled_from(HASHES[:4])  # duplicate copies: evictions that keep a hash
        hashes = data.draw(st.lists(few, min_size=free, max_size=free))
        blocks: list[list[BlockId]] = []
        for pool in (self.a, self.b):
            outcome = pool.reserve([], free)
            assert outcome is not None
            assert outcome.removed == []
            pairs = [pool.allocate_cached(outcome.reservation, h) for h in hashes]
            pool.cancel(outcome.reservation)
            pool.release_many([block for block, _ in pairs])
            blocks.append([block for block, _ in pairs])
        self.twin.update(zip(blocks[0], blocks[1], strict=True))

    @precondition(lambda self: len(self.pins) > 1)  # keep one open: chains meet its pins
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.a.cancel(pin.a)
        self.b.cancel(pin.b)

    @invariant()
    def same_structure(self) -> None:
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        self.b.check_invariants()
        assert _counts(self.a) == _counts(self.b)
        assert _hits(self.a, HASHES) == _hits(self.b, HASHES)
        assert [self.twin[i] for i in _lru_ids(self.a)] == _lru_ids(self.b), "LRU order"
        for pin in self.pins:
            assert (len(pin.a), pin.a.fresh, pin.a.prefix_len) == (
                len(pin.b),
                pin.b.fresh,
                pin.b.prefix_len,
            )


ADMIT_SETTINGS = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow
def test_admit_equals_the_composition() -> None:
    """Random admissions, caching, frees and pins on twin pools, then proof that the run
    reached every kind of chain: hits of each state, duplicates, evictions, refusals."""
    missing = run_until_covered(AdmitMachine, ADMIT_SETTINGS, COVERAGE, ADMIT_STATES)
    assert not missing, f"the generator never reached {missing}; coverage: {dict(COVERAGE)}"


ADMIT_STATES = [
    "full_hit",
    "partial_hit",
    "resident_after_miss",
    "duplicate_hit",
    "prefix_active",
    "prefix_inactive",
    "prefix_pinned",
    "extra",
    "removed_hash",
    "evicted_copy_keeping_hash",
    "evicted_with_idle_hits",
    "none",
    "capacity_error",
    "bad_hash",
    "bad_hash_after_miss",
    "cache_many",
    "cache_private",
    "free",
]


# --------------------------------------------------------------- targeted examples


def test_fully_cached_chain_references_every_resident_copy() -> None:
    """A chain that is all resident gets the resident copies themselves, root first,
    and counts the ones already in use as active_cached."""
    pool, ids = _cached_pool(6, [1, 2, 3])
    held = pool.admit([2])
    assert held is not None
    assert held.blocks == [ids[1]]
    admission = pool.admit([1, 2, 3])
    assert admission == Admission([ids[0], ids[1], ids[2]], 3, 1, [])
    assert _counts(pool) == (3, 4, 0)
    assert _hits(pool, [1, 2, 3]) == [True, True, True]
    pool.release_many(_ids(admission.blocks[::-1]))
    pool.release_many(_ids(held.blocks))
    assert _counts(pool) == (0, 0, 3)
    pool.check_invariants()


def test_partly_cached_chain_stops_at_the_first_miss() -> None:
    """After the first miss, later resident hashes are not hits: they get fresh private
    copies, and their resident copies stay idle."""
    pool, ids = _cached_pool(8, [1, 2, 3])
    admission = pool.admit([1, 9, 2, 3])
    assert admission is not None
    assert (admission.cached, admission.active_cached, admission.removed) == (1, 0, [])
    assert admission.blocks[0] == ids[0]
    assert len(admission.blocks) == 4
    assert not set(admission.blocks[1:]) & set(ids)
    assert _counts(pool) == (4, 4, 2)
    assert _hits(pool, [1, 9, 2, 3]) == [True, None, False, False]
    # The later blocks are private: caching one under 2 adds a second copy of 2.
    assert pool.cache_private(BlockId(admission.blocks[2]), 2) is False
    pool.check_invariants()


def test_extra_blocks_come_after_the_chain() -> None:
    """``blocks`` holds the chain's blocks (the cached prefix first), then ``extra``
    private ones: new copies, all referenced by the caller."""
    pool, ids = _cached_pool(8, [1])
    whole = pool.admit([1], extra=2)
    assert whole is not None
    assert (whole.blocks[0], whole.cached, len(whole.blocks)) == (ids[0], 1, 3)
    pool.release_many(_ids(whole.blocks[::-1]))
    admission = pool.admit([1, 5], extra=2)
    assert admission is not None
    assert (admission.cached, admission.active_cached) == (1, 0)
    assert admission.blocks[0] == ids[0]
    assert len(set(admission.blocks)) == 4
    assert _counts(pool) == (4, 4, 0)
    assert [pool.cache_private(BlockId(b), 7) for b in admission.blocks[1:]] == [
        True,
        False,
        False,
    ]
    pool.release_many(_ids(admission.blocks[::-1]))
    assert _counts(pool) == (0, 0, 4)


def test_evictions_are_reported_in_lru_order() -> None:
    """``removed`` lists evicted hashes from the LRU head on, skipping the chain's own
    hits (pinned before evicting) and a hash that keeps another copy."""
    for chain, extra, removed in (
        ([20, 21], 0, [12, 10]),
        ([12, 30, 31], 0, [10, 13]),  # the head is a hit: it is pinned, not evicted
        ([], 4, [12, 10, 13, 11]),
    ):
        pool, _ = _cached_pool(4, [12, 10, 13, 11])
        twin, _ = _cached_pool(4, [12, 10, 13, 11])
        admission = pool.admit(chain, extra)
        assert admission is not None
        assert admission.removed == removed
        composed = compose(twin, chain, extra)
        assert composed is not None
        assert composed.removed == removed
        assert _counts(pool) == _counts(twin)
    pool, _ = _cached_pool(4, [7, 8, 7, 9])  # 7 goes only with its second copy
    admission = pool.admit([], 3)
    assert admission is not None
    assert admission.removed == [8, 7]
    assert _hits(pool, [7, 8, 9]) == [None, None, False]


def test_empty_admission_changes_nothing() -> None:
    """An empty chain with no extra is granted with no blocks and no effect."""
    pool, _ = _cached_pool(2, [1, 2])
    assert pool.admit([]) == Admission([], 0, 0, [])
    assert _counts(pool) == (0, 0, 2)
    assert _hits(pool, [1, 2]) == [False, False]
    pool.check_invariants()


@pytest.mark.parametrize("capacity", [1, 3, 5])
def test_chain_plus_extra_equal_to_capacity_fits(capacity: int) -> None:
    """A request of exactly the pool's size fits an empty pool, and a full pool of idle
    copies by evicting all of them; one block more is a CapacityError."""
    chain = list(range(100, 100 + capacity - 1))
    empty = BlockPool(capacity)
    admission = empty.admit(chain, 1)
    assert admission is not None
    assert (len(admission.blocks), admission.cached, admission.removed) == (capacity, 0, [])
    assert _counts(empty) == (capacity, capacity, 0)
    idle, _ = _cached_pool(capacity, range(capacity))
    admission = idle.admit(chain, 1)
    assert admission is not None
    assert admission.removed == list(range(capacity))
    for pool in (BlockPool(capacity), _cached_pool(capacity, range(capacity))[0]):
        before = _counts(pool)
        with pytest.raises(CapacityError):
            pool.admit(chain, 2)
        with pytest.raises(CapacityError):
            pool.admit([*chain, 7, 8])
        assert _counts(pool) == before
        pool.check_invariants()


def test_refused_admit_changes_nothing() -> None:
    """A pool whose capacity is held by requests refuses, and stays exactly as it was."""
    pool, _ = _cached_pool(4, [1, 2])
    held = pool.admit([1, 5])
    assert held is not None
    before = (_counts(pool), _hits(pool, [1, 2, 5, 6]), _lru_ids(pool))
    assert pool.admit([1, 2, 6], 1) is None  # 2 fresh: 1 is free, the idle 2 is a hit
    assert (_counts(pool), _hits(pool, [1, 2, 5, 6]), _lru_ids(pool)) == before
    pool.check_invariants()


def test_duplicate_hits_count_once_per_position() -> None:
    """A hash repeated in the chain takes one reference per position on the same copy."""
    pool, ids = _cached_pool(4, [1])
    twin, _ = _cached_pool(4, [1])
    admission = pool.admit([1, 1, 1])
    composed = compose(twin, [1, 1, 1])
    assert admission == Admission([ids[0]] * 3, 3, 0, [])
    assert composed is not None
    assert (composed.cached, composed.active_cached) == (3, 0)
    assert _counts(pool) == _counts(twin) == (1, 3, 0)
    pool.release_many(_ids(admission.blocks))
    assert _counts(pool) == (0, 0, 1)
    held = pool.admit([1])  # now in use: every position of a repeat counts as active
    assert held is not None
    again = pool.admit([1, 1, 2])
    assert again is not None
    assert (again.blocks[:2], again.cached, again.active_cached) == ([ids[0]] * 2, 2, 2)


def test_duplicate_hits_longer_than_the_pool_are_a_capacity_error() -> None:
    """The capacity check counts chain positions, not distinct copies, although the
    composition would fit three references to one copy in a pool of two."""
    pool, _ = _cached_pool(2, [1])
    with pytest.raises(CapacityError):
        pool.admit([1, 1, 1])
    assert _counts(pool) == (0, 0, 1)
    twin, _ = _cached_pool(2, [1])
    composed = compose(twin, [1, 1, 1])
    assert composed is not None
    assert composed.cached == 3


@pytest.mark.parametrize(
    "make",
    [iter, lambda c: (h for h in c), lambda c: dict.fromkeys(c), set],
    ids=["iterator", "generator", "dict", "set"],
)
def test_a_chain_that_is_no_sequence_is_refused_and_changes_nothing(
    make: Callable[[list[int]], Iterable[int]],
) -> None:
    """One rule for every layer (`kvpool.pool.items`): a run of items is a Sequence."""
    pool, _ = _cached_pool(8, [1, 2, 3])
    twin, _ = _cached_pool(8, [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="chain must be a sequence"):
        pool.admit(make([1, 2, 9, 3]), 1)  # type: ignore[arg-type]
    assert _counts(pool) == _counts(twin)


@pytest.mark.parametrize("make", [tuple, lambda c: range(1, 4)], ids=["tuple", "range"])
def test_any_sequence_chain_acts_like_a_list(make: Callable[[list[int]], Iterable[int]]) -> None:
    """A chain given as any sequence gives the list's answer and effect."""
    chain = list(make([1, 2, 9, 3]))
    pool, _ = _cached_pool(8, [1, 2, 3])
    twin, _ = _cached_pool(8, [1, 2, 3])
    got = pool.admit(make([1, 2, 9, 3]), 1)  # type: ignore[arg-type]
    want = twin.admit(chain, 1)
    assert got is not None
    assert want is not None
    assert (got.cached, got.active_cached, len(got.blocks)) == (
        want.cached,
        want.active_cached,
        len(want.blocks),
    )
    assert got.cached >= 2
    assert _counts(pool) == _counts(twin)


# ---------------------------------- on the bad-input recipe: every kind of pool state

RECIPE_CHAINS: dict[str, tuple[list[int], int]] = {
    "idle_hits_then_miss": ([11, 0, 10, ABSENT], 0),
    "pinned_and_active_hits": ([12, 1, 13], 0),
    "duplicate_hits": ([11, 11, 0], 1),
    "resident_after_miss": ([10, ABSENT, 11, 12], 0),
    "idle_hit_and_evictions": ([MAX_HASH, 50, 51, 52], 2),
    "extra_evicting_everything": ([], 7),
    "evicted_hash": ([EVICTED], 0),
    "refused_idle_hits": ([11, 0, 10, ABSENT], 4),
    "refused_extra": ([], 8),
}


def _names_of(recipe: Recipe, blocks: list[int]) -> list[str]:
    names: dict[int, str] = {block: name for name, block in recipe.ids.items()}
    return [names[b] for b in blocks]


@pytest.mark.parametrize("name", sorted(RECIPE_CHAINS))
def test_admit_equals_the_composition_on_the_recipe(name: str) -> None:
    """On the bad-input recipe (idle, active, pinned, duplicate copies, reservations),
    admit and the composition answer alike and leave identical full snapshots."""
    chain, extra = RECIPE_CHAINS[name]
    admitted, composed = build(), build()
    got = admitted.pool.admit(chain, extra)
    want = compose(composed.pool, chain, extra)
    assert (got is None) == (want is None) == name.startswith("refused")
    if got is not None and want is not None:
        assert (got.cached, got.active_cached, got.removed) == (
            want.cached,
            want.active_cached,
            want.removed,
        )
        assert len(got.blocks) == len(want.blocks) == len(chain) + extra
        cached = _names_of(admitted, got.blocks[: got.cached])
        assert cached == _names_of(composed, want.blocks[: want.cached])
        admitted.held += tuple(f"admitted{i}" for i in range(len(got.blocks)))
        composed.held += tuple(f"admitted{i}" for i in range(len(want.blocks)))
        for i, (a_id, b_id) in enumerate(zip(got.blocks, want.blocks, strict=True)):
            admitted.ids[f"admitted{i}"] = BlockId(a_id)
            composed.ids[f"admitted{i}"] = BlockId(b_id)
    result = snapshot(admitted)
    assert result == snapshot(composed)
    if got is None:  # and a refusal leaves the recipe as it was built
        assert result == snapshot(build())
