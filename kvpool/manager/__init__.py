"""The request-level KV manager: block tables over a `BlockPool`, router-visible events.

`KvManager` is synchronous and I/O-free (see `kvpool.manager.kv_manager` for its rules).
`open_manager` / `ManagerClient` run it inside an actor (`kvpool.manager.client`); they
are imported lazily, so ``import kvpool.manager`` does not load the actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.lazy import lazy_attributes
from kvpool.manager.types import (
    Allocation,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepUpdate,
)

if TYPE_CHECKING:
    from kvpool.manager._api import KvManager
    from kvpool.manager.client import ManagerClient, open_manager
else:
    from kvpool.manager.kv_manager import KvManager

__all__ = [
    "Allocation",
    "KvManager",
    "ManagerClient",
    "ManagerStats",
    "PoolUsage",
    "PrefillCost",
    "SlotRequest",
    "StepAllocations",
    "StepOutcome",
    "StepUpdate",
    "open_manager",
]

__getattr__ = lazy_attributes(
    __name__,
    {"ManagerClient": "kvpool.manager.client", "open_manager": "kvpool.manager.client"},
)
