"""A vLLM v1-style mock engine over the KV manager, and a multi-engine simulation.

`MockEngine` schedules requests through one pool (see `kvpool.engine.engine` for the
rules) and jumps over decode-only steps (`MockEngine.fast_forward`), `Simulation` runs
several engines on a workload in simulated time,
`run_simulation` opens one KV client per engine (a manager actor each, `open_actor_kv`,
or an inline manager, `open_local_kv`), runs, and returns the `Report`. `Arrivals` says
when each request is sent (open or closed loop, multi-turn sessions); an `Sla` adds
goodput to the report.
"""

from kvpool.engine.arrivals import Arrivals
from kvpool.engine.config import EngineConfig, PreemptionMode
from kvpool.engine.dispatch import Dispatch, Dispatcher, LeastLoaded, RoundRobin, make_policy
from kvpool.engine.engine import MockEngine, RequestOutput, StepResult
from kvpool.engine.goodput import Goodput, Sla
from kvpool.engine.kv_client import KvClient, LocalKvClient, TimedKvClient
from kvpool.engine.metrics import EngineStats
from kvpool.engine.record import RequestRecord
from kvpool.engine.report import (
    Distribution,
    Report,
    WorkerReport,
    build_report,
    format_report,
    report_json,
)
from kvpool.engine.runner import (
    KV_BACKENDS,
    SimulationRun,
    open_actor_kv,
    open_local_kv,
    run_simulation,
)
from kvpool.engine.simulation import Simulation
from kvpool.engine.timing import (
    AicTiming,
    Dynamo16ProfileTiming,
    Dynamo16Timing,
    DynamoTiming,
    ProfileDataError,
    ProfileTiming,
    StepTiming,
    StepWork,
    TimingModel,
)

__all__ = [
    "KV_BACKENDS",
    "AicTiming",
    "Arrivals",
    "Dispatch",
    "Dispatcher",
    "Distribution",
    "Dynamo16ProfileTiming",
    "Dynamo16Timing",
    "DynamoTiming",
    "EngineConfig",
    "EngineStats",
    "Goodput",
    "KvClient",
    "LeastLoaded",
    "LocalKvClient",
    "MockEngine",
    "PreemptionMode",
    "ProfileDataError",
    "ProfileTiming",
    "Report",
    "RequestOutput",
    "RoundRobin",
    "RequestRecord",
    "Simulation",
    "SimulationRun",
    "Sla",
    "StepResult",
    "StepTiming",
    "StepWork",
    "TimedKvClient",
    "TimingModel",
    "WorkerReport",
    "build_report",
    "format_report",
    "make_policy",
    "open_actor_kv",
    "open_local_kv",
    "report_json",
    "run_simulation",
]
