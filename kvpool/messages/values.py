"""Result records the actor hands back as they are: an admission and pool statistics."""

from __future__ import annotations

import msgspec

from kvpool.pool import Admission

__all__ = ["Admission", "PoolStats"]


class PoolStats(msgspec.Struct, frozen=True, gc=False):
    """A snapshot of the pool's occupancy plus its cumulative counters.

    ``reserves``, ``reserve_failures`` and ``evictions`` are the pool's own counters
    (`BlockPool.reserves`: every reserve or admit, including a waiter's retries and
    undone calls; evictions in copies); ``waiters`` is the actor's FIFO length.
    """

    capacity: int
    num_active: int
    num_inactive: int
    num_active_refs: int
    reserves: int
    reserve_failures: int
    evictions: int
    waiters: int
