"""The synchronous, I/O-free core: vLLM's GPU KV-cache block pool (no asyncio, no anyio)."""

from kvpool.pool.block_pool import BlockPool
from kvpool.pool.types import MAX_HASH, BlockId, PrefixHit, Reservation, ReserveOutcome

__all__ = ["MAX_HASH", "BlockId", "BlockPool", "PrefixHit", "Reservation", "ReserveOutcome"]
