"""Workloads for the mock engine: the embedded synthetic default and Mooncake traces."""

from kvpool.workloads.mooncake import (
    MOONCAKE_BLOCK_SIZE,
    MooncakeRecord,
    parse_mooncake_lines,
    read_mooncake_trace,
)
from kvpool.workloads.spec import RequestSpec, Segment, mix_seed
from kvpool.workloads.synthetic import SyntheticWorkload, default_workload

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "MooncakeRecord",
    "RequestSpec",
    "Segment",
    "SyntheticWorkload",
    "default_workload",
    "mix_seed",
    "parse_mooncake_lines",
    "read_mooncake_trace",
]
