"""Every caller mistake raises its PoolError subclass, names the culprit and changes nothing.

Pools cannot be copied, so each case builds the same pool twice from one deterministic
recipe, makes the bad call on one of them, and compares full observable snapshots of both:
counts, reservation sizes, `prefix_hit` of every known hash, then the eviction order shown
by draining both pools one block at a time, before and after releasing everything the
recipe holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest

from kvpool import (
    AlreadyCachedError,
    BlockId,
    BlockNotReferencedError,
    BlockPool,
    CapacityError,
    ForeignReservationError,
    InvalidArgumentError,
    InvalidHashError,
    InvariantViolationError,
    PoolError,
    PrefixHit,
    PrefixNotResidentError,
    Reservation,
    ReservationClosedError,
    ReservationExhaustedError,
    UnknownBlockError,
)
from kvpool.pool import MAX_HASH

T = TypeVar("T")

CAPACITY = 14
ABSENT = 42  # a valid hash that is never resident
EVICTED = 99  # a hash that was resident once and was evicted
KNOWN_HASHES = (0, 1, 10, 11, 12, 13, ABSENT, EVICTED, MAX_HASH)


@dataclass
class Recipe:
    """A populated pool and handles to everything in it, named by role."""

    pool: BlockPool
    ids: dict[str, BlockId]
    reservations: dict[str, Reservation]
    other_pool: BlockPool
    other_id: BlockId
    other_reservation: Reservation
    # Ids the recipe holds a request reference on, in the order a snapshot releases them.
    held: tuple[str, ...] = ()
    # Reservations a snapshot cancels, in this order.
    open_reservations: tuple[str, ...] = ()
    # A value a bad call made on the spot (a fresh ReserveOutcome), for its message check.
    culprit: object = None


def _reserve(pool: BlockPool, prefix: list[int], fresh: int) -> Reservation:
    outcome = pool.reserve(prefix, fresh)
    assert outcome is not None
    return outcome.reservation


def build() -> Recipe:
    """A pool holding every kind of state: inactive copies (with a duplicate hash),
    active private and cached copies, a pinned-only copy, open / spent / empty /
    cancelled reservations, a released id, an evicted id, and free capacity."""
    pool = BlockPool(CAPACITY)
    ids: dict[str, BlockId] = {}
    res: dict[str, Reservation] = {}

    # A cached copy squeezed out by a full-capacity reserve: its id is stale.
    r = _reserve(pool, [], 1)
    ids["evicted"], _ = pool.allocate_cached(r, EVICTED)
    pool.cancel(r)
    pool.release(ids["evicted"])
    squeeze = pool.reserve([], CAPACITY)
    assert squeeze is not None
    assert squeeze.removed == [EVICTED]
    pool.cancel(squeeze.reservation)

    # A private copy released again: its id is stale.
    r = _reserve(pool, [], 1)
    ids["released"] = pool.allocate_private(r)
    pool.cancel(r)
    pool.release(ids["released"])

    r = _reserve(pool, [], 7)
    for name, block_hash in (("a", 10), ("b", 11), ("c", 12), ("d", 11)):  # d duplicates b
        ids[name] = pool.allocate_private(r)
        pool.cache_private(ids[name], block_hash)
    ids["zero"], _ = pool.allocate_cached(r, 0)
    ids["max"], _ = pool.allocate_cached(r, MAX_HASH)
    ids["private"] = pool.allocate_private(r)
    pool.cancel(r)
    r = _reserve(pool, [], 2)
    ids["active"], _ = pool.allocate_cached(r, 13)
    ids["one"], _ = pool.allocate_cached(r, 1)
    pool.cancel(r)
    for name in ("c", "b", "zero", "a", "d", "max"):
        pool.release(ids[name])
    # LRU now: c b zero a d max.  Pin c (the head) and the active copy of 1.
    res["pinned"] = _reserve(pool, [12, 1], 1)
    # Pin and unpin a (moving it to the tail) and the active 13: a closed reservation.
    res["closed"] = _reserve(pool, [13, 10], 1)
    pool.cancel(res["closed"])
    res["spent"] = _reserve(pool, [], 1)
    ids["spent_private"] = pool.allocate_private(res["spent"])
    res["empty"] = _reserve(pool, [], 0)
    res["open"] = _reserve(pool, [], 1)
    # LRU: b zero d max a; copies 10 + reserved 2 = 12 of 14.

    other_pool = BlockPool(4)
    other_reservation = _reserve(other_pool, [], 2)
    other_id = other_pool.allocate_private(other_reservation)
    return Recipe(
        pool=pool,
        ids=ids,
        reservations=res,
        other_pool=other_pool,
        other_id=other_id,
        other_reservation=other_reservation,
        held=("private", "active", "one", "spent_private"),
        open_reservations=("pinned", "spent", "empty", "open"),
    )


def _attempt(call: Callable[[T], object], arg: T) -> object:
    """A call's result, or the name of the error it raised."""
    try:
        return call(arg)
    except PoolError as error:
        return type(error).__name__


def _state(pool: BlockPool) -> tuple[object, ...]:
    hits = tuple((h, pool.prefix_hit(h)) for h in KNOWN_HASHES)
    return (pool.num_active(), pool.num_active_refs(), pool.num_inactive(), hits)


def _drain(pool: BlockPool, log: list[object]) -> list[Reservation]:
    """Fill free capacity, then evict one block at a time, logging each step."""
    free = pool.capacity - pool.num_active() - pool.num_inactive()
    first = pool.reserve([], free)
    assert first is not None
    log.append(("fill", free, first.removed, _state(pool)))
    taken = [first.reservation]
    while (outcome := pool.reserve([], 1)) is not None:
        log.append(("evict", outcome.removed, _state(pool)))
        taken.append(outcome.reservation)
    log.append(("full", _state(pool)))
    return taken


def snapshot(recipe: Recipe) -> list[object]:
    """Everything observable about the recipe's pool; consumes the pool."""
    pool = recipe.pool
    other = recipe.other_pool
    log: list[object] = [_state(pool), _state(other), len(recipe.other_reservation)]
    for name, r in sorted(recipe.reservations.items()):
        log.append((name, len(r), r.fresh, r.prefix_len, r.closed))
    pool.check_invariants()
    taken = _drain(pool, log)
    log.extend(
        ("cancel", name, _attempt(pool.cancel, recipe.reservations[name]))
        for name in recipe.open_reservations
    )
    for r in taken:
        pool.cancel(r)
    log.extend(("release", name, _attempt(pool.release, recipe.ids[name])) for name in recipe.held)
    log.append(_state(pool))
    pool.check_invariants()
    for r in _drain(pool, log):
        pool.cancel(r)
    pool.check_invariants()
    return log


@dataclass(frozen=True)
class Case:
    """One bad call: what it does, the error it must raise, and the value it must name."""

    call: Callable[[Recipe], object]
    error: type[PoolError]
    culprit: Callable[[Recipe], object]


def _id(name: str) -> Callable[[Recipe], BlockId]:
    return lambda rc: rc.ids[name]


def _res(name: str) -> Callable[[Recipe], Reservation]:
    return lambda rc: rc.reservations[name]


def _const(value: object) -> Callable[[Recipe], object]:
    return lambda rc: value


BAD_HASHES: dict[str, object] = {
    "negative": -1,
    "2**64": 2**64,
    "float": 7.0,
    "float_equal_to_resident": 10.0,
    "bool_equal_to_resident": True,
    "str": "10",
    "none": None,
    "unhashable_list": [10],
}

Call = Callable[[Recipe], object]


def _reserve_call(prefix: object, fresh: object) -> Call:
    return lambda rc: rc.pool.reserve(prefix, fresh)  # type: ignore[arg-type]


def _release(block: Call) -> Call:
    return lambda rc: rc.pool.release(block(rc))  # type: ignore[arg-type]


def _cache_private(block: Call, block_hash: object) -> Call:
    return lambda rc: rc.pool.cache_private(block(rc), block_hash)  # type: ignore[arg-type]


def _admit_call(chain: object, extra: object) -> Call:
    return lambda rc: rc.pool.admit(chain, extra)  # type: ignore[arg-type]


def _prefix_hit(block_hash: object) -> Call:
    return lambda rc: rc.pool.prefix_hit(block_hash)  # type: ignore[arg-type]


def _with_reservation(method: str, reservation: Call, *args: object) -> Call:
    """Call ``pool.<method>(reservation, *args)``, remembering the reservation as culprit."""

    def call(rc: Recipe) -> object:
        rc.culprit = reservation(rc)
        return getattr(rc.pool, method)(rc.culprit, *args)

    return call


def _culprit(rc: Recipe) -> object:
    return rc.culprit


def _spent_pinned(rc: Recipe) -> Reservation:
    """The pinned reservation after its one fresh block was allocated (a legal step)."""
    reservation = rc.reservations["pinned"]
    rc.pool.allocate_private(reservation)
    return reservation


def _release_twice(rc: Recipe) -> None:
    rc.pool.release(rc.ids["active"])  # legal: drops the last reference
    rc.pool.release(rc.ids["active"])


def _bad_cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}

    # -- prefix hash not resident (checked before capacity, whatever `fresh` asks)
    for label, prefix, missing in (
        ("never_seen", [ABSENT], ABSENT),
        ("evicted", [EVICTED], EVICTED),
        ("after_resident", [10, ABSENT], ABSENT),
        ("after_pinned_and_duplicate", [12, 12, 1, ABSENT, 11], ABSENT),
    ):
        for fresh in (0, 1, CAPACITY):
            cases[f"reserve_prefix_not_resident_{label}_fresh{fresh}"] = Case(
                _reserve_call(prefix, fresh), PrefixNotResidentError, _const(missing)
            )

    # -- any use of a cancelled reservation, and an exhausted one
    reservation_uses: dict[str, tuple[str, tuple[object, ...]]] = {
        "activate_prefix": ("activate_prefix", ()),
        "allocate_private": ("allocate_private", ()),
        "allocate_cached_new_hash": ("allocate_cached", (50,)),
        "allocate_cached_resident_hash": ("allocate_cached", (10,)),
        "cancel_again": ("cancel", ()),
    }
    for label, (method, args) in reservation_uses.items():
        cases[f"cancelled_reservation_{label}"] = Case(
            _with_reservation(method, _res("closed"), *args), ReservationClosedError, _culprit
        )
    exhausted: dict[str, Call] = {
        "spent": _res("spent"),
        "empty": _res("empty"),
        "pinned_after_one_allocation": _spent_pinned,
    }
    for label, reservation in exhausted.items():
        for method, args in reservation_uses.values():
            if method.startswith("allocate"):
                suffix = f"_{args[0]}" if args else ""
                cases[f"{method}{suffix}_exhausted_{label}"] = Case(
                    _with_reservation(method, reservation, *args),
                    ReservationExhaustedError,
                    _culprit,
                )

    # -- unknown or stale block ids
    stale_ids: dict[str, Call] = {
        "released": _id("released"),
        "evicted": _id("evicted"),
        "never_allocated_zero": _const(0),
        "never_allocated_negative": _const(-1),
        "never_allocated_huge": _const(2**70),
        "forged_later_serial": lambda rc: rc.ids["private"] + (1 << 32),
        "forged_earlier_serial": lambda rc: rc.ids["private"] - (1 << 32),
        "other_pool": lambda rc: rc.other_id,
        "float_of_live_id": lambda rc: float(rc.ids["private"]),
        "bool": _const(True),
        "str_of_live_id": lambda rc: str(rc.ids["private"]),
        "none": _const(None),
    }
    for label, block in stale_ids.items():
        cases[f"release_unknown_{label}"] = Case(_release(block), UnknownBlockError, block)
        cases[f"cache_private_unknown_{label}"] = Case(
            _cache_private(block, 50), UnknownBlockError, block
        )

    # -- release of a copy that holds no request reference
    for name in ("b", "zero", "d", "c"):  # inactive (incl. a duplicate), pinned-only
        cases[f"release_unreferenced_{name}"] = Case(
            _release(_id(name)), BlockNotReferencedError, _id(name)
        )
    cases["release_twice_after_last_reference"] = Case(
        _release_twice, BlockNotReferencedError, _id("active")
    )

    # -- cache_private of an already-cached copy: inactive, active, pinned, duplicate
    for name, block_hash in (("a", 10), ("a", 50), ("active", 13), ("c", 77), ("d", 11)):
        cases[f"cache_private_already_cached_{name}_{block_hash}"] = Case(
            _cache_private(_id(name), block_hash), AlreadyCachedError, _id(name)
        )

    # -- a reservation from another pool, or not a reservation at all
    not_mine: dict[str, Call] = {
        "other_pool": lambda rc: rc.other_reservation,
        "none": _const(None),
        "int": _const(3),
        "outcome_not_reservation": lambda rc: rc.pool.reserve([], 0),
    }
    for label, reservation in not_mine.items():
        for method, args in reservation_uses.values():
            cases[f"{method}_foreign_{label}"] = Case(
                _with_reservation(method, reservation, *args), ForeignReservationError, _culprit
            )

    # -- hashes that are not ints in [0, 2**64)
    for label, bad in BAD_HASHES.items():
        cases[f"prefix_hit_bad_hash_{label}"] = Case(
            _prefix_hit(bad), InvalidHashError, _const(bad)
        )
        cases[f"reserve_bad_hash_{label}"] = Case(
            _reserve_call([bad], 0), InvalidHashError, _const(bad)
        )
        cases[f"reserve_bad_hash_after_resident_{label}"] = Case(
            _reserve_call([10, 12, bad], 1), InvalidHashError, _const(bad)
        )
        cases[f"cache_private_bad_hash_{label}"] = Case(
            _cache_private(_id("private"), bad), InvalidHashError, _const(bad)
        )
        cases[f"allocate_cached_bad_hash_{label}"] = Case(
            _with_reservation("allocate_cached", _res("open"), bad), InvalidHashError, _const(bad)
        )

    # -- a prefix that is not a sequence of ints
    for label, bad_prefix in {"none": None, "int": 10, "str": "10", "empty_str": ""}.items():
        cases[f"reserve_prefix_not_a_sequence_{label}"] = Case(
            _reserve_call(bad_prefix, 1), InvalidArgumentError, _const(bad_prefix)
        )

    # -- fresh that is not an int >= 0 (checked first: nothing gets pinned)
    for label, bad_fresh in {"negative": -1, "float": 1.0, "bool": True, "str": "1"}.items():
        for prefix_label, prefix in (("no_prefix", []), ("prefix", [10, 12])):
            cases[f"reserve_bad_fresh_{label}_{prefix_label}"] = Case(
                _reserve_call(prefix, bad_fresh), InvalidArgumentError, _const(bad_fresh)
            )
    cases["reserve_bad_fresh_none"] = Case(
        _reserve_call([], None), InvalidArgumentError, _const(None)
    )

    # -- admit checks its whole chain, extra and size before it pins, evicts or allocates
    # anything: each bad chain asks for 2 extra blocks, so that a valid version of the
    # call would pin its hits and evict (only 2 blocks are free).
    not_sequences = {
        "none": None,
        "int": 5,
        "str": "abc",
        "empty_str": "",
        "bytes": b"ab",
        "bytearray": bytearray(b"ab"),
    }
    for label, bad_chain in not_sequences.items():
        cases[f"admit_chain_not_a_sequence_{label}"] = Case(
            _admit_call(bad_chain, 2), InvalidArgumentError, _const(bad_chain)
        )
    for label, bad in BAD_HASHES.items():
        chains: dict[str, object] = {
            "at_root": [bad],
            # the first miss, unless it looks like a resident hash (True, 10.0): a hit then
            "after_hits": [10, 12, bad, 11],
            "after_first_miss": [10, 12, ABSENT, bad],
            "after_a_miss_and_resident_hashes": [10, ABSENT, 11, 1, bad],
            "last_of_a_tuple": (11, 0, 13, ABSENT, bad),
        }
        for where, chain in chains.items():
            cases[f"admit_bad_hash_{where}_{label}"] = Case(
                _admit_call(chain, 2), InvalidHashError, _const(bad)
            )
    bad_extras: dict[str, object] = {"negative": -1, "float": 1.5, "integral_float": 1.0}
    bad_extras |= {"bool": True, "none": None, "str": "1"}
    for label, bad_extra in bad_extras.items():
        for chain_label, chain in (("no_chain", []), ("hits_and_miss", [10, 12, ABSENT])):
            cases[f"admit_bad_extra_{label}_{chain_label}"] = Case(
                _admit_call(chain, bad_extra), InvalidArgumentError, _const(bad_extra)
            )
    too_big: dict[str, tuple[list[int], int]] = {
        "misses": ([ABSENT] * (CAPACITY + 1), 0),
        "extra_only": ([], CAPACITY + 1),
        "hits_plus_extra": ([10, 12], CAPACITY - 1),
        "duplicate_hits": ([10] * (CAPACITY + 1), 0),  # one copy, but a block per position
        "huge_extra": ([10], 2**70),
    }
    for label, (chain, extra) in too_big.items():
        cases[f"admit_larger_than_the_pool_{label}"] = Case(
            _admit_call(chain, extra), CapacityError, _const(CAPACITY)
        )
    return cases


CASES = _bad_cases()


def _names(message: str, culprit: object) -> bool:
    """Whether the message quotes ``repr(culprit)`` as a whole token (0 is not in 10)."""
    return re.search(rf"(?<![\w.]){re.escape(repr(culprit))}(?![\w.])", message) is not None


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_call_raises_and_changes_nothing(name: str) -> None:
    case = CASES[name]
    untouched = build()
    touched = build()
    with pytest.raises(PoolError) as raised:
        case.call(touched)
    assert type(raised.value) is case.error, f"{type(raised.value).__name__}: {raised.value}"
    culprit = case.culprit(touched)
    assert _names(str(raised.value), culprit), f"{raised.value!s} does not name {culprit!r}"
    touched.pool.check_invariants()
    if name.endswith("_pinned_after_one_allocation"):
        untouched.pool.allocate_private(untouched.reservations["pinned"])  # the legal step
    if name == "release_twice_after_last_reference":
        untouched.pool.release(untouched.ids["active"])  # the legal first release
    if name.endswith("_foreign_outcome_not_reservation"):
        untouched.pool.reserve([], 0)  # the legal reserve whose outcome was misused
    assert snapshot(touched) == snapshot(untouched)


LEGAL_CALLS: dict[str, tuple[Callable[[Recipe], object], bool]] = {
    "prefix_hit": (lambda rc: rc.pool.prefix_hit(11), False),
    "check_invariants": (lambda rc: rc.pool.check_invariants(), False),
    "release_active": (lambda rc: rc.pool.release(rc.ids["active"]), True),
    "cancel_pinned": (lambda rc: rc.pool.cancel(rc.reservations["pinned"]), True),
    "pin_duplicate": (lambda rc: rc.pool.reserve([11], 0), True),
    "pin_second_lru_entry": (lambda rc: rc.pool.reserve([0], 0), True),
    "allocate_private": (lambda rc: rc.pool.allocate_private(rc.reservations["open"]), True),
    "admit_hit_and_fresh": (lambda rc: rc.pool.admit([11, ABSENT]), True),
    "admit_nothing": (lambda rc: rc.pool.admit([]), False),
    # Refused (None): 3 idle hits would be pinned, and 5 fresh blocks do not fit.
    "admit_refused": (lambda rc: rc.pool.admit([11, 0, 10, ABSENT], 4), False),
}


@pytest.mark.parametrize("name", sorted(LEGAL_CALLS))
def test_snapshot_tells_legal_changes_from_queries(name: str) -> None:
    """The comparison above is not vacuous: a legal mutation changes the snapshot."""
    call, changes = LEGAL_CALLS[name]
    untouched, touched = build(), build()
    call(touched)
    assert (snapshot(touched) != snapshot(untouched)) == changes


def test_recipe_is_what_it_claims() -> None:
    """Pin down the recipe so the cases above exercise the states their names promise."""
    rc = build()
    pool = rc.pool
    assert (pool.num_active(), pool.num_active_refs(), pool.num_inactive()) == (7, 4, 5)
    assert [pool.prefix_hit(h) for h in (12, 11, EVICTED, ABSENT)] == [
        PrefixHit(is_active=True),  # pinned only
        PrefixHit(is_active=False),
        None,
        None,
    ]
    assert [len(rc.reservations[n]) for n in ("pinned", "closed", "spent", "empty", "open")] == [
        3,
        0,
        0,
        0,
        1,
    ]
    assert rc.reservations["closed"].closed
    pool.check_invariants()
    # Eviction order b zero d max a: 11 goes only with its second copy (d).
    outcome = pool.reserve([], CAPACITY - 12 + 5)
    assert outcome is not None
    assert outcome.removed == [0, 11, MAX_HASH, 10]


@pytest.mark.parametrize("capacity", [0, -1, 2**32, 1.0, 4.5, "4", None, True, [4]])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        BlockPool(capacity)  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError)  # the contract: a ValueError
    assert _names(str(raised.value), capacity)


def test_reserve_with_an_iterator_prefix_is_a_caller_error() -> None:
    """A one-shot iterator of a non-resident hash is the caller's mistake, not a pool bug."""
    untouched, touched = build(), build()
    with pytest.raises(PoolError) as raised:
        touched.pool.reserve(iter([10, ABSENT]), 1)  # type: ignore[arg-type]
    assert not isinstance(raised.value, InvariantViolationError), str(raised.value)
    assert snapshot(touched) == snapshot(untouched)
