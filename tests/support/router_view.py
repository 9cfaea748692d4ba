"""`RouterView`: a router's hash -> parent index kept from decoded KV events, asserting
what real routers rely on (a parent stored before its child, Removed names only stored
hashes, no resident hash stored twice, each BlockStored's tokens re-hash to its hashes).
Shared by the router-view, manager-actor and manager state-machine tests."""

from __future__ import annotations

from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvpool.hashing import block_hashes


class RouterView:
    """hash -> parent hash, maintained from decoded events exactly as a router would."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.parents: dict[int, int | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert block_hash in self.parents, f"Removed of unknown hash {block_hash}"
                    del self.parents[block_hash]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.parents.clear()

    def _stored(self, event: BlockStored) -> None:
        assert event.block_size == self.block_size
        assert event.block_hashes, "empty BlockStored"
        parent = event.parent_block_hash
        assert parent is None or parent in self.parents, f"child stored before parent {parent}"
        assert len(event.token_ids) == len(event.block_hashes) * self.block_size
        assert block_hashes(event.token_ids, self.block_size, parent) == event.block_hashes
        for block_hash in event.block_hashes:
            assert block_hash not in self.parents, f"second Stored of resident {block_hash}"
            self.parents[block_hash] = parent
            parent = block_hash
