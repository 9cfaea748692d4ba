"""The request-level KV manager: block tables over a `BlockPool`, router-visible events.

Synchronous and I/O-free; see `kvpool.manager.kv_manager` for the rules it follows.
"""

from kvpool.manager.kv_manager import KvManager
from kvpool.manager.types import Allocation, ManagerStats, PrefillCost

__all__ = ["Allocation", "KvManager", "ManagerStats", "PrefillCost"]
