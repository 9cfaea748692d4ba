"""kvpool: an exact, fast, concurrency-safe model of vLLM's GPU KV-cache block pool.

The names a user needs, from every layer. The async ones (`open_pool`, `open_manager`
and their clients) are loaded on first use, so ``import kvpool.pool`` stays free of
anyio and of every actor module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.errors import (
    ActorClosedError,
    ActorCrashedError,
    AlreadyCachedError,
    BlockError,
    BlockNotReferencedError,
    BlockSharedError,
    CannotWaitError,
    CapacityError,
    DuplicateRequestError,
    ForeignReservationError,
    InvalidArgumentError,
    InvalidHashError,
    InvariantViolationError,
    KvpoolError,
    ManagerClosedError,
    ManagerCrashedError,
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
from kvpool.lazy import lazy_attributes
from kvpool.pool import Admission, BlockId, BlockPool, PrefixHit, Reservation, ReserveOutcome

if TYPE_CHECKING:
    from kvpool.actors import Lease, PoolClient, open_pool
    from kvpool.manager import KvManager, ManagerClient, open_manager

__version__ = "0.1.0"

__getattr__ = lazy_attributes(
    __name__,
    {
        "Lease": "kvpool.actors",
        "PoolClient": "kvpool.actors",
        "open_pool": "kvpool.actors",
        "KvManager": "kvpool.manager",
        "ManagerClient": "kvpool.manager",
        "open_manager": "kvpool.manager",
    },
)


__all__ = [
    "Admission",
    "ActorClosedError",
    "ActorCrashedError",
    "AlreadyCachedError",
    "BlockError",
    "BlockId",
    "BlockNotReferencedError",
    "BlockPool",
    "BlockSharedError",
    "CannotWaitError",
    "CapacityError",
    "DuplicateRequestError",
    "ForeignReservationError",
    "InvalidArgumentError",
    "InvalidHashError",
    "InvariantViolationError",
    "KvManager",
    "KvpoolError",
    "ManagerClosedError",
    "ManagerCrashedError",
    "Lease",
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
    "__version__",
    "open_manager",
    "open_pool",
]
