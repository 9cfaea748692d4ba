"""Result records the actors hand back as they are: an admission, the pool's occupancy
and its statistics.

`PoolUsage` is kvpool's one occupancy type: the manager's `StepOutcome`, its stats reply,
the engine's report and the pool actor's `PoolStats` (which extends it with counters)
all carry it.
"""

from __future__ import annotations

import msgspec

from kvpool.pool import Admission

__all__ = ["Admission", "PoolStats", "PoolUsage"]


class PoolUsage(msgspec.Struct, frozen=True, gc=False):
    """The pool's occupancy: blocks in use or reserved, evictable idle blocks, capacity."""

    num_active: int
    num_inactive: int
    capacity: int

    @property
    def fraction(self) -> float:
        """KV usage as vLLM reports it: active blocks over capacity (0.0 when idle)."""
        return self.num_active / self.capacity


class PoolStats(PoolUsage, frozen=True, gc=False):
    """The pool's occupancy (`PoolUsage`) plus its cumulative counters.

    ``reserves``, ``reserve_failures`` and ``evictions`` are the pool's own counters
    (`BlockPool.reserves`: every reserve or admit, including a waiter's retries and
    undone calls; evictions in copies); ``waiters`` is the actor's FIFO length.
    """

    num_active_refs: int
    reserves: int
    reserve_failures: int
    evictions: int
    waiters: int
