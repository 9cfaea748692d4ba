"""Result records the actor hands back as they are: an admission and pool statistics."""

from __future__ import annotations

import msgspec


class Admission(msgspec.Struct, frozen=True, gc=False):
    """One admitted chain: the caller now owns one reference to every block in ``blocks``.

    ``blocks`` lists the ids in chain order, then the ``extra`` ones; the first ``cached``
    are the chain's resident prefix (``active_cached`` of them were already in use), the
    rest are fresh private copies. ``removed`` lists the hashes whose last copy was evicted
    to make room, in eviction order.
    """

    blocks: list[int]
    cached: int
    active_cached: int
    removed: list[int]


class PoolStats(msgspec.Struct, frozen=True, gc=False):
    """A snapshot of the pool's occupancy plus cumulative counters since the actor started.

    ``reserves`` counts successful reservations (admissions included) and
    ``reserve_failures`` the ones that did not fit; a reservation or admission undone
    because its caller never read it is not counted (its evictions are). ``evictions``
    counts hashes whose last copy was evicted (the router-visible removals); ``waiters``
    is the FIFO queue's length.
    """

    capacity: int
    num_active: int
    num_inactive: int
    num_active_refs: int
    reserves: int
    reserve_failures: int
    evictions: int
    admissions: int
    waiters: int
