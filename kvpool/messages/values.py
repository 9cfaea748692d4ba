"""Result records the actor hands back as they are: an admission and pool statistics."""

from __future__ import annotations

import msgspec

from kvpool.pool import Admission

__all__ = ["Admission", "PoolStats"]


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
