"""The request-level KV manager: block tables over a `BlockPool`, router-visible events.

`KvManager` is synchronous and I/O-free (see `kvpool.manager.kv_manager` for its rules).
`ManagerClient` drives it, inline or inside the manager actor (`open_manager`); the
service's layout: `kvpool.manager.messages`, `kvpool.manager.operations`,
`kvpool.manager.client`. The client is imported lazily, so ``import kvpool.manager``
does not load the actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.lazy import lazy_attributes
from kvpool.manager.types import (
    AdmissionGate,
    Allocation,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepSchedule,
    StepUpdate,
    StretchAllocations,
)

if TYPE_CHECKING:
    from kvpool.manager._api import KvManager
    from kvpool.manager.client import LocalKvClient, ManagerClient, TimedKvClient, open_manager
else:
    from kvpool.manager.kv_manager import KvManager

__all__ = [
    "AdmissionGate",
    "Allocation",
    "ChainAllocations",
    "DecodeChain",
    "DecodeRun",
    "DecodeStretch",
    "KvManager",
    "LocalKvClient",
    "ManagerClient",
    "ManagerStats",
    "PoolUsage",
    "PrefillCost",
    "QueuedRequest",
    "RunAllocations",
    "SlotRequest",
    "StepAllocations",
    "StepOutcome",
    "StepSchedule",
    "StepUpdate",
    "StretchAllocations",
    "TimedKvClient",
    "open_manager",
]

__getattr__ = lazy_attributes(
    __name__,
    dict.fromkeys(
        ("LocalKvClient", "ManagerClient", "TimedKvClient", "open_manager"),
        "kvpool.manager.client",
    ),
)
