"""kvpool: an exact, fast, concurrency-safe model of vLLM's GPU KV-cache block pool."""

from kvpool.actors import open_pool
from kvpool.errors import (
    AlreadyCachedError,
    BlockError,
    BlockNotReferencedError,
    CapacityError,
    ForeignReservationError,
    InvalidArgumentError,
    InvalidHashError,
    InvariantViolation,
    PoolClosed,
    PoolCrashed,
    PoolError,
    PrefixNotResidentError,
    ReservationClosedError,
    ReservationError,
    ReservationExhaustedError,
    UnknownBlockError,
)
from kvpool.pool import BlockId, BlockPool, PrefixHit, Reservation, ReserveOutcome

__version__ = "0.1.0"

__all__ = [
    "AlreadyCachedError",
    "BlockError",
    "BlockId",
    "BlockNotReferencedError",
    "BlockPool",
    "CapacityError",
    "ForeignReservationError",
    "InvalidArgumentError",
    "InvalidHashError",
    "InvariantViolation",
    "PoolClosed",
    "PoolCrashed",
    "PoolError",
    "PrefixHit",
    "PrefixNotResidentError",
    "Reservation",
    "ReservationClosedError",
    "ReservationError",
    "ReservationExhaustedError",
    "ReserveOutcome",
    "UnknownBlockError",
    "open_pool",
]
