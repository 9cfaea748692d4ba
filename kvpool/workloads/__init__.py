"""Workloads for the mock engine: the embedded synthetic default and Mooncake traces."""

from kvpool.workloads.mooncake import (
    MAX_TIMESTAMP_MS,
    MAX_TRACE_TOKENS,
    MOONCAKE_BLOCK_SIZE,
    MooncakeRecord,
    MooncakeTrace,
    TraceWarning,
    iter_mooncake_lines,
    parse_mooncake_lines,
    read_mooncake_trace,
)
from kvpool.workloads.session import Session
from kvpool.workloads.spec import RequestSpec, Segment, mix_seed
from kvpool.workloads.synthetic import SyntheticSessions, SyntheticWorkload, default_workload

__all__ = [
    "MAX_TIMESTAMP_MS",
    "MAX_TRACE_TOKENS",
    "MOONCAKE_BLOCK_SIZE",
    "MooncakeRecord",
    "MooncakeTrace",
    "RequestSpec",
    "Segment",
    "Session",
    "SyntheticSessions",
    "SyntheticWorkload",
    "TraceWarning",
    "default_workload",
    "iter_mooncake_lines",
    "mix_seed",
    "parse_mooncake_lines",
    "read_mooncake_trace",
]
