"""The report's routing section: what a router did to the load and the cache of each worker.

Only a routed run has one (``--dispatch kv``, ``llm-d`` or a plug-in), so two routers can
be compared on the same trace: per worker its requests, prompt tokens, prefix-cache hit
rate (hit over queried tokens), mean KV usage over time, and queueing (arrival to first
scheduled, finished requests); then the spread between workers (max over min of the
requests and of the prompt tokens; None when a worker got none) and the fleet's prefix
reuse as Dynamo's replay reports it (cached prompt tokens over all prompt tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvpool.engine.engine import MockEngine
from kvpool.engine.metrics import held_durations, mean, percentile_of_sorted, weighted_mean


class RoutedWorker(msgspec.Struct, frozen=True):
    """One worker's share of a routed run (times in simulated seconds)."""

    worker: int
    requests: int
    prompt_tokens: int
    prefix_cache_hit_rate: float | None
    kv_usage_mean: float
    queue_mean_s: float
    queue_p99_s: float


class RoutingSummary(msgspec.Struct, frozen=True):
    """The routing section of a `kvpool.engine.report.Report` (module docstring)."""

    router: str
    event_delay_ms: float
    workers: list[RoutedWorker]
    requests_spread: float | None
    prompt_tokens_spread: float | None
    prefix_hit_tokens: int
    prefix_reuse: float


def _spread(values: Sequence[int]) -> float | None:
    low = min(values)
    return max(values) / low if low > 0 else None


def routing_summary(
    engines: Sequence[MockEngine], router: str, event_delay_s: float
) -> RoutingSummary:
    """The routing section of a finished run of ``engines`` routed by ``router``."""
    end = max(engine.clock for engine in engines)
    workers = []
    for index, engine in enumerate(engines):
        stats = engine.stats
        queued = sorted(
            r.first_scheduled_s - r.arrival_s
            for r in stats.requests
            if r.first_scheduled_s is not None
        )
        queries = stats.prefix_query_tokens
        workers.append(
            RoutedWorker(
                worker=index,
                requests=stats.submitted,
                prompt_tokens=stats.prompt_tokens,
                prefix_cache_hit_rate=stats.prefix_hit_tokens / queries if queries else None,
                kv_usage_mean=weighted_mean(stats.usage, held_durations(stats.sample_times, end)),
                queue_mean_s=mean(queued),
                queue_p99_s=percentile_of_sorted(queued, 99),
            )
        )
    prompt = sum(w.prompt_tokens for w in workers)
    hits = sum(engine.stats.prefix_hit_tokens for engine in engines)
    return RoutingSummary(
        router=router,
        event_delay_ms=1e3 * event_delay_s,
        workers=workers,
        requests_spread=_spread([w.requests for w in workers]),
        prompt_tokens_spread=_spread([w.prompt_tokens for w in workers]),
        prefix_hit_tokens=hits,
        prefix_reuse=hits / prompt if prompt else 0.0,
    )


def routing_lines(summary: RoutingSummary) -> Iterable[str]:
    """The routing section as text lines."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def ratio(x: float | None) -> str:
        return "n/a (a worker got none)" if x is None else f"{x:.2f}x"

    yield ""
    yield (
        f"routing: {summary.router}, events delayed {summary.event_delay_ms:g} ms; "
        f"prefix reuse {summary.prefix_reuse:.4f} ({summary.prefix_hit_tokens} cached "
        "prompt tokens)"
    )
    for w in summary.workers:
        yield (
            f"  worker {w.worker}: {w.requests} requests, {w.prompt_tokens} prompt tokens, "
            f"hit rate {pct(w.prefix_cache_hit_rate)}, KV usage mean {pct(w.kv_usage_mean)}, "
            f"queued mean {1e3 * w.queue_mean_s:.2f} ms, p99 {1e3 * w.queue_p99_s:.2f} ms"
        )
    yield (
        f"  spread (max/min): requests {ratio(summary.requests_spread)}, "
        f"prompt tokens {ratio(summary.prompt_tokens_spread)}"
    )
