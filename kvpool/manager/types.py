"""The manager's public value types: an allocation's result, a prefill cost, counters."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvpool.events import KVEvent
from kvpool.messages.values import PoolUsage
from kvpool.pool import BlockId


class Allocation(msgspec.Struct, frozen=True, gc=False):
    """What one successful `KvManager.allocate` did to the request's block table.

    ``block_ids`` are the ids appended by this call, root first (a reused prefix first,
    then the fresh blocks); ``cached_blocks`` counts the reused prefix blocks among them
    (0 except on a request's first allocation); ``removed`` lists the hashes whose last
    resident copy this call's reservation evicted, in eviction order.
    """

    block_ids: list[BlockId]
    cached_blocks: int
    removed: list[int]


class PrefillCost(msgspec.Struct, frozen=True, gc=False):
    """What admitting a request would cost now.

    ``cached_blocks``: leading full blocks the next allocation would reuse from the
    prefix cache; ``active_cached_blocks``: how many of those are in use by someone
    (they cost no free capacity); ``new_blocks``: fresh blocks still needed to hold every
    token the request has.
    """

    cached_blocks: int
    active_cached_blocks: int
    new_blocks: int


class ManagerStats(msgspec.Struct, frozen=True, gc=False):
    """Counters for a report, counted the way vLLM counts them.

    Prefix-cache queries and hits are in tokens and counted once per successful first
    allocation of a request (again after each preemption: a re-admission queries again);
    with prefix caching off nothing is counted, as vLLM reports no prefix-cache stats
    then. ``evictions`` is the pool's own count (`BlockPool.evictions`: copies evicted),
    read, not counted again. ``preemptions`` counts preempt calls that released blocks.
    ``kv_events`` counts the BlockStored and BlockRemoved events queued so far, and with
    KV cache events off the ones that would have been: what a router was (or would have
    been) told, whether or not anybody listens.
    """

    num_requests: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    preemptions: int
    kv_events: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over queried tokens; 0.0 before the first query."""
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


class StepUpdate(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """What one request's step leaves for the manager, applied in this order.

    ``append``: generated tokens to append; ``computed``: the new computed-token count to
    mark (-1: the watermark does not move); ``free``: the request finished.
    """

    request_id: str
    append: list[int]
    computed: int
    free: bool


class StepOutcome(msgspec.Struct, frozen=True, gc=False, tag=True):
    """After a step's updates (`KvManager.finish_step`): the events they and the step's
    allocations queued, drained, the pool's occupancy and counters after them, and the
    probed request's `PrefillCost` after them (None: no probe)."""

    events: list[KVEvent]
    usage: PoolUsage
    stats: ManagerStats
    cost: PrefillCost | None = None


class SlotRequest(msgspec.Struct, frozen=True, gc=False):
    """One request's part of a step's allocations (`KvManager.allocate_steps`): append
    ``new_tokens`` (those generated since the manager last heard), then grow the table
    to hold ``num_tokens`` and mark them computed."""

    request_id: str
    num_tokens: int
    new_tokens: Sequence[int] = []


class StepAllocations(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A step's allocations (`KvManager.allocate_steps`): one `Allocation` per slot that
    fit, in order (fewer than the slots: the next one did not fit, and the rest were not
    tried), the events queued so far, drained, the counters after them, and the probed
    request's `PrefillCost` after them (None: no probe)."""

    allocations: list[Allocation]
    events: list[KVEvent]
    stats: ManagerStats
    cost: PrefillCost | None = None


__all__ = [
    "Allocation",
    "ManagerStats",
    "PoolUsage",
    "PrefillCost",
    "SlotRequest",
    "StepAllocations",
    "StepOutcome",
    "StepUpdate",
]
