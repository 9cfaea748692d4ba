"""Goodput: the requests that met latency targets (SLAs), as Dynamo's replay reports it.

A finished request is *good* when each target set holds, bounds included: its TTFT
(arrival to first token) ``<= ttft_ms``, its mean inter-token latency (``(finish -
first token) / (output tokens - 1)``; a one-token request has none and meets any ITL
target) ``<= itl_ms``, its end-to-end latency ``<= e2e_ms``. Dynamo's figures, named
as its report names them: ``goodput_completed_requests``, and the good requests and
their output tokens per simulated second of the run
(``goodput_request_throughput_rps``, ``goodput_output_throughput_tok_s``).
Unlike Dynamo, which refuses an end-to-end target beside the others, all three may be
set at once (a request must meet every one).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvpool.engine.record import RequestRecord
from kvpool.errors import InvalidArgumentError


class Sla(msgspec.Struct, frozen=True):
    """Latency targets in milliseconds (None: not a target); at least one is set."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        targets = (self.ttft_ms, self.itl_ms, self.e2e_ms)
        if all(target is None for target in targets):
            raise InvalidArgumentError("an SLA needs at least one target")
        for name, target in zip(("ttft_ms", "itl_ms", "e2e_ms"), targets, strict=True):
            if target is not None and not 0 < target < float("inf"):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {target!r}")

    def met_by(self, record: RequestRecord) -> bool:
        """True if ``record`` finished and met every target."""
        first, finish = record.first_token_s, record.finish_s
        if record.rejected or first is None or finish is None:
            return False
        if self.ttft_ms is not None and not (first - record.arrival_s) * 1e3 <= self.ttft_ms:
            return False
        if self.e2e_ms is not None and not (finish - record.arrival_s) * 1e3 <= self.e2e_ms:
            return False
        if self.itl_ms is not None and record.output_tokens > 1:
            itl = (finish - first) / (record.output_tokens - 1)
            if not itl * 1e3 <= self.itl_ms:
                return False
        return True


class Goodput(msgspec.Struct, frozen=True):
    """The requests that met the run's `Sla`, and their rates over simulated time."""

    goodput_completed_requests: int
    goodput_request_throughput_rps: float
    goodput_output_throughput_tok_s: float


def goodput_of(records: Iterable[RequestRecord], sla: Sla, duration_s: float) -> Goodput:
    """The `Goodput` of ``records`` (any order) over a run of ``duration_s`` seconds."""
    good = tokens = 0
    for record in records:
        if sla.met_by(record):
            good += 1
            tokens += record.output_tokens
    return Goodput(
        goodput_completed_requests=good,
        goodput_request_throughput_rps=good / duration_s if duration_s > 0 else 0.0,
        goodput_output_throughput_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
    )
