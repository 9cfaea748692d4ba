"""A vLLM v1-style mock engine over the KV manager, and a multi-engine simulation.

`MockEngine` schedules requests through one pool (see `kvpool.engine.engine` for the
rules), `Simulation` runs several engines on a workload in simulated time, and
`build_report` summarises a run.
"""

from kvpool.engine.config import EngineConfig, PreemptionMode, TimingModel
from kvpool.engine.engine import MockEngine, StepResult
from kvpool.engine.kv_client import (
    KvClient,
    KvUsage,
    LocalKvClient,
    StepOutcome,
    StepUpdate,
    TimedKvClient,
)
from kvpool.engine.metrics import EngineStats
from kvpool.engine.report import (
    Distribution,
    Report,
    WorkerReport,
    build_report,
    format_report,
    report_json,
)
from kvpool.engine.simulation import Dispatch, Simulation

__all__ = [
    "Dispatch",
    "Distribution",
    "EngineConfig",
    "EngineStats",
    "KvClient",
    "KvUsage",
    "LocalKvClient",
    "MockEngine",
    "PreemptionMode",
    "Report",
    "Simulation",
    "StepOutcome",
    "StepResult",
    "StepUpdate",
    "TimedKvClient",
    "TimingModel",
    "WorkerReport",
    "build_report",
    "format_report",
    "report_json",
]
