"""The synchronous, I/O-free core: vLLM's GPU KV-cache block pool (no asyncio, no anyio)."""

from typing import TYPE_CHECKING

from kvpool.pool.types import (
    MAX_HASH,
    Admission,
    BlockId,
    PrefixHit,
    Reservation,
    ReserveOutcome,
    RunAdmission,
)

if TYPE_CHECKING:
    from kvpool.pool._api import BlockPool
else:
    from kvpool.pool.block_pool import BlockPool

__all__ = [
    "MAX_HASH",
    "Admission",
    "BlockId",
    "BlockPool",
    "PrefixHit",
    "Reservation",
    "ReserveOutcome",
    "RunAdmission",
]
