"""Per-worker views of cached prefixes, and the prefix overlap a router computes on them.

A block is named by Dynamo's sequence hash (`kvpool.hashing.block_hashes`), which covers
the block's tokens and its whole prefix, so the overlap of a request with a worker is the
number of the request's leading block hashes the worker holds, stopping at the first miss:
what Dynamo's radix-tree indexer (``find_matches``) returns walking from the root.

kvpool's engines name cached blocks by exactly these hashes when KV events are on (the
manager's `kvpool.hashing.BlockHasher`), so `EventView` indexes a BlockStored's
``block_hashes`` as they come; re-hashing its ``token_ids`` gives the same numbers
(``tests/routing/test_routing_views.py`` checks it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class EventView:
    """One worker's cached hashes, exactly as its KV events describe them."""

    __slots__ = ("blocks",)

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def apply(self, events: Sequence[KVEvent]) -> None:
        """Apply ``events`` in order: stored adds, removed drops, cleared empties."""
        blocks = self.blocks
        for event in events:
            if isinstance(event, BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def overlap(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` this worker holds."""
        blocks = self.blocks
        for depth, block_hash in enumerate(hashes):
            if block_hash not in blocks:
                return depth
        return len(hashes)


class PredictedView:
    """One worker's cache predicted from the router's own decisions, each block kept for
    ``ttl_s`` after the last request routed there that holds it: Dynamo's approximate
    indexer (``use_kv_events: false``, ``router_ttl_secs``)."""

    __slots__ = ("_expiry", "_prune_at", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._expiry: dict[int, float] = {}
        self._prune_at = 1024

    def routed(self, hashes: Sequence[int], now: float) -> None:
        """A request holding ``hashes`` was routed here at ``now``."""
        expiry = self._expiry
        until = now + self.ttl_s
        for block_hash in hashes:
            expiry[block_hash] = until
        if len(expiry) > self._prune_at:  # amortised: drop the expired ones
            for block_hash in [h for h, t in expiry.items() if t <= now]:
                del expiry[block_hash]
            self._prune_at = max(1024, 2 * len(expiry))

    def overlap(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of ``hashes`` predicted cached here at ``now``."""
        expiry = self._expiry
        for depth, block_hash in enumerate(hashes):
            if expiry.get(block_hash, -1.0) <= now:
                return depth
        return len(hashes)


class LruView:
    """One worker's blocks as routed there, the least recently routed dropped beyond
    ``capacity``: the Gateway API inference extension's approximate prefix index
    (``lruCapacityPerServer``)."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def routed(self, hashes: Sequence[int]) -> None:
        """A request holding ``hashes`` was routed here: they become the most recent."""
        blocks = self._blocks
        for block_hash in hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def overlap(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` in the index."""
        blocks = self._blocks
        for depth, block_hash in enumerate(hashes):
            if block_hash not in blocks:
                return depth
        return len(hashes)
