"""KV-aware routers for a fleet of engines: Dynamo's, llm-d's, or a user's.

`kvpool.routing.policy` states what a router is given and answers; `Delivery` hands it
events and finishes no earlier than a real router would get them; `EventView`,
`PredictedView` and `LruView` are the per-worker prefix views routers build on.
Depends on events, hashing and workloads only (never on the engine).
"""

from kvpool.routing.delivery import Delivery
from kvpool.routing.kv import KvRouter, KvRouterConfig
from kvpool.routing.llmd import LlmdRouter
from kvpool.routing.plugin import BUILT_IN, is_router_name, load_factory, make_router
from kvpool.routing.policy import (
    DispatchPolicy,
    ReportsOverlap,
    RouterSettings,
    WorkerLoad,
    uses_kv_events,
)
from kvpool.routing.prompt import prompt_hashes
from kvpool.routing.views import EventView, LruView, PredictedView

__all__ = [
    "BUILT_IN",
    "Delivery",
    "DispatchPolicy",
    "EventView",
    "KvRouter",
    "KvRouterConfig",
    "LlmdRouter",
    "LruView",
    "PredictedView",
    "ReportsOverlap",
    "RouterSettings",
    "WorkerLoad",
    "is_router_name",
    "load_factory",
    "make_router",
    "prompt_hashes",
    "uses_kv_events",
]
