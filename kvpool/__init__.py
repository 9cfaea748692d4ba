"""kvpool: an exact, fast, concurrency-safe model of vLLM's GPU KV-cache block pool."""

from kvpool.actors import PoolClient, open_pool
from kvpool.errors import (
    AlreadyCachedError,
    BlockError,
    BlockNotReferencedError,
    CapacityError,
    DuplicateRequestError,
    ForeignReservationError,
    InvalidArgumentError,
    InvalidHashError,
    InvariantViolationError,
    KvpoolError,
    PoolClosedError,
    PoolCrashedError,
    PoolError,
    PrefixNotResidentError,
    RequestError,
    ReservationClosedError,
    ReservationError,
    ReservationExhaustedError,
    TokenCountError,
    TraceError,
    UnknownBlockError,
    UnknownRequestError,
    WrongLoopError,
)
from kvpool.manager import KvManager
from kvpool.manager.client import ManagerClient, open_manager
from kvpool.pool import BlockId, BlockPool, PrefixHit, Reservation, ReserveOutcome

__version__ = "0.1.0"

__all__ = [
    "AlreadyCachedError",
    "BlockError",
    "BlockId",
    "BlockNotReferencedError",
    "BlockPool",
    "CapacityError",
    "DuplicateRequestError",
    "ForeignReservationError",
    "InvalidArgumentError",
    "InvalidHashError",
    "InvariantViolationError",
    "KvManager",
    "KvpoolError",
    "ManagerClient",
    "PoolClient",
    "PoolClosedError",
    "PoolCrashedError",
    "PoolError",
    "PrefixHit",
    "PrefixNotResidentError",
    "RequestError",
    "Reservation",
    "ReservationClosedError",
    "ReservationError",
    "ReservationExhaustedError",
    "ReserveOutcome",
    "TokenCountError",
    "TraceError",
    "UnknownBlockError",
    "UnknownRequestError",
    "WrongLoopError",
    "open_manager",
    "open_pool",
]
