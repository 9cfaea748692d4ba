"""What an engine counts while it runs, and the summary statistics reports use."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.engine.request import RequestRecord


@dataclass(slots=True)
class EngineStats:
    """One engine's counters and per-step samples (simulated time, seconds).

    Prefix-cache queries and hits are in tokens, counted once per admission the way the
    manager counts them: the request's tokens at that moment, and the cached prefix its
    first allocation reused; with prefix caching off nothing is queried (both stay 0, as
    vLLM reports no prefix-cache stats then). ``usage`` is sampled once per step, after
    the step, at ``sample_times``; the cache keeps that usage until the next step changes
    it, idle stretches included, so reports weigh each sample by how long it held.

    Latency samples follow ``vllm bench serve``: ``ttft_s`` and ``latency_s`` (end to
    end) per finished request, ``tpot_s`` per finished request of more than one output
    token (``(latency - ttft) / (output - 1)``), ``itl_s`` every gap between two
    consecutive output tokens of a request (a compact ``array('d')``). ``requests``
    holds a `RequestRecord` per finished or rejected request, in that order.
    """

    submitted: int = 0
    rejected: int = 0
    completed: int = 0
    aborted: int = 0  # dropped by `MockEngine.abort` (a client went away)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    event_batches: int = 0  # steps that drained KV events (published if there is a sink)
    sample_times: list[float] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    query_samples: list[int] = field(default_factory=list)
    hit_samples: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: array[float] = field(default_factory=lambda: array("d"))
    requests: list[RequestRecord] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default, which
    ``vllm bench serve`` uses); 0.0 for no values."""
    return percentile_of_sorted(sorted(values), q)


def percentile_of_sorted(ordered: Sequence[float], q: float) -> float:
    """`percentile` of values already in ascending order (sort once, ask many times)."""
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; 0.0 for no values."""
    return math.fsum(values) / len(values) if values else 0.0


def held_durations(times: Sequence[float], end: float) -> list[float]:
    """How long each sample at ``times`` (ascending) held: until the next one, the last
    until ``end`` (never negative); none for no samples (an engine that never stepped)."""
    if not times:
        return []
    return [max(0.0, later - now) for now, later in zip(times, [*times[1:], end], strict=True)]


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """The mean of ``values`` weighted by ``weights``; plain mean if they sum to 0."""
    total = math.fsum(weights)
    if total <= 0:
        return mean(values)
    return math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The smallest value that ``q`` percent of the weight lies at or below (0.0 for no
    values); with weights summing to 0, the unweighted `percentile`."""
    total = math.fsum(weights)
    if total <= 0:
        return percentile(values, q)
    target = total * q / 100.0
    seen = 0.0
    pairs = sorted(zip(values, weights, strict=True))
    for value, weight in pairs:
        seen += weight
        if seen >= target and weight > 0:
            return value
    return max(value for value, weight in pairs if weight > 0)
