"""The simulation report: per-worker and total figures, as text or JSON."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate

import msgspec

from kvpool.engine.engine import MockEngine
from kvpool.engine.goodput import Goodput, Sla, goodput_of
from kvpool.engine.metrics import (
    EngineStats,
    held_durations,
    mean,
    percentile_of_counts,
    percentile_of_sorted,
    sum_of_counts,
    weighted_summary,
)
from kvpool.engine.routing_report import RoutingSummary, routing_lines
from kvpool.manager import PoolUsage


class Distribution(msgspec.Struct, frozen=True):
    """Summary of samples: mean, median, 90th and 99th percentile, maximum."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """Summarise ``values`` (all zeros when there are none)."""
        ordered = sorted(values)
        return cls(
            mean=mean(ordered),
            p50=percentile_of_sorted(ordered, 50),
            p90=percentile_of_sorted(ordered, 90),
            p99=percentile_of_sorted(ordered, 99),
            max=ordered[-1] if ordered else 0.0,
        )

    @classmethod
    def of_counts(cls, counts: Mapping[float, int]) -> Distribution:
        """Summarise the multiset in which each value occurs ``counts[value]`` times:
        exactly what `of` gives for the expanded values."""
        ordered = sorted(value for value, count in counts.items() if count > 0)
        cumulative = list(accumulate(counts[value] for value in ordered))
        return cls(
            mean=sum_of_counts(counts) / cumulative[-1] if ordered else 0.0,
            p50=percentile_of_counts(ordered, cumulative, 50),
            p90=percentile_of_counts(ordered, cumulative, 90),
            p99=percentile_of_counts(ordered, cumulative, 99),
            max=ordered[-1] if ordered else 0.0,
        )

    @classmethod
    def over_time(cls, values: Sequence[float], durations: Sequence[float]) -> Distribution:
        """Summarise a level that held ``values[i]`` for ``durations[i]``: the time-weighted
        mean, the levels not exceeded 50% and 99% of the time, and the maximum."""
        mean_of, (p50, p90, p99), largest = weighted_summary(values, durations, (50, 90, 99))
        return cls(mean=mean_of, p50=p50, p90=p90, p99=p99, max=largest)


class WorkerReport(msgspec.Struct, frozen=True):
    """One worker's figures (``worker`` None: the whole cluster).

    Token counts: ``prompt_tokens`` and ``generated_tokens`` of the requests served;
    ``prefill_tokens_computed`` counts every prompt token computed, recomputation after
    preemption included, cached ones excluded. Prefix-cache figures are in tokens;
    ``prefix_cache_hit_rate`` is None when nothing was queried (prefix caching off).
    ``kv_usage`` (active blocks over capacity) is over simulated time: each step's
    post-step sample weighs as long as it held, until the engine's next step or the end
    of the run (idle stretches count, at the idle cache's usage). Latencies are in
    simulated seconds over finished requests, as ``vllm bench serve`` defines them:
    ``ttft_s`` arrival to first token, ``latency_s`` arrival to last token (end to end),
    ``tpot_s`` per request of two or more output tokens ``(latency - ttft) / (output -
    1)``, ``itl_s`` every gap between consecutive output tokens of a request;
    ``output_tokens_per_s`` is the generated tokens over the run's simulated time.
    ``kv_event_batches`` counts the steps that changed what a router sees (one
    `KVEventBatch` each, sent to the event sink when there is one); ``leaked_blocks`` is
    the pool's active count after the run: 0 unless a block leaked. ``goodput`` (with an
    `Sla` only) counts the finished requests that met it (`kvpool.engine.goodput`).
    """

    worker: int | None
    requests_submitted: int
    requests_completed: int
    requests_rejected: int
    prompt_tokens: int
    generated_tokens: int
    prefill_tokens_computed: int
    steps: int
    simulated_s: float
    busy_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float | None
    kv_usage: Distribution
    preemptions: int
    evictions: int
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    latency_s: Distribution
    output_tokens_per_s: float
    kv_event_batches: int
    num_gpu_blocks: int
    leaked_blocks: int
    goodput: Goodput | None = None


class Report(msgspec.Struct, frozen=True):
    """A whole run: what was simulated, how long it took, per worker and in total.

    ``sla`` is the goodput targets, if any. With ``max_sim_time_s`` the clock stopped
    there: ``requests_unfinished`` were in flight (waiting or running) and aborted,
    ``requests_unstarted`` never sent (due later, or, closed loop, never given a slot).
    """

    workload: str
    settings: dict[str, object]
    wall_s: float
    simulated_s: float
    requests_per_wall_s: float
    workers: list[WorkerReport]
    total: WorkerReport
    sla: Sla | None = None
    max_sim_time_s: float | None = None
    requests_unfinished: int = 0
    requests_unstarted: int = 0
    routing: RoutingSummary | None = None


def worker_report(
    worker: int | None,
    stats: Sequence[EngineStats],
    clock: float,
    final: Sequence[PoolUsage],
    end: float | None = None,
    sla: Sla | None = None,
) -> WorkerReport:
    """Combine the stats of one or more engines (samples pooled) into a `WorkerReport`.

    ``clock`` is the simulated time reported; ``end`` (default ``clock``) the end of the
    run, up to which each engine's last usage sample holds; ``sla`` the goodput targets.
    """
    until = clock if end is None else end
    usage: Sequence[float]
    held: Sequence[float]
    itl: Mapping[float, int]
    if len(stats) == 1:  # one engine's samples as they are: nothing to pool
        usage = stats[0].usage
        held = held_durations(stats[0].sample_times, until)
        itl = stats[0].itl_counts
    else:
        usage = pooled_usage = array("d")
        held = pooled_held = array("d")
        pooled_itl: dict[float, int] = {}
        itl = pooled_itl
        for s in stats:
            pooled_usage.extend(s.usage)
            pooled_held.extend(held_durations(s.sample_times, until))
            for gap, count in s.itl_counts.items():
                pooled_itl[gap] = pooled_itl.get(gap, 0) + count

    def total(name: str) -> int:
        return sum(getattr(s, name) for s in stats)

    queries = total("prefix_query_tokens")
    hits = total("prefix_hit_tokens")
    generated = total("generated_tokens")
    return WorkerReport(
        worker=worker,
        requests_submitted=total("submitted"),
        requests_completed=total("completed"),
        requests_rejected=total("rejected"),
        prompt_tokens=total("prompt_tokens"),
        generated_tokens=generated,
        prefill_tokens_computed=total("prefill_tokens"),
        steps=total("steps"),
        simulated_s=clock,
        busy_s=sum(s.busy_s for s in stats),
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_hit_rate=hits / queries if queries else None,
        kv_usage=Distribution.over_time(usage, held),
        preemptions=total("preemptions"),
        evictions=total("evictions"),
        ttft_s=Distribution.of([t for s in stats for t in s.ttft_s]),
        tpot_s=Distribution.of([t for s in stats for t in s.tpot_s]),
        itl_s=Distribution.of_counts(itl),
        latency_s=Distribution.of([t for s in stats for t in s.latency_s]),
        output_tokens_per_s=generated / until if until > 0 else 0.0,
        kv_event_batches=total("event_batches"),
        num_gpu_blocks=sum(u.capacity for u in final),
        leaked_blocks=sum(u.num_active for u in final),
        goodput=None
        if sla is None
        else goodput_of((r for s in stats for r in s.requests), sla, until),
    )


def build_report(
    engines: Sequence[MockEngine],
    final: Sequence[PoolUsage],
    *,
    workload: str,
    settings: dict[str, object],
    wall_s: float,
    sla: Sla | None = None,
    max_sim_time_s: float | None = None,
    unfinished: int = 0,
    unstarted: int = 0,
    routing: RoutingSummary | None = None,
) -> Report:
    """The report of a finished run; ``final`` is each engine's `MockEngine.final_usage`;
    ``unfinished`` and ``unstarted`` what a ``max_sim_time_s`` cut (`Simulation`)."""
    simulated = max(engine.clock for engine in engines)
    workers = [
        worker_report(engine.rank, [engine.stats], engine.clock, [usage], simulated, sla)
        for engine, usage in zip(engines, final, strict=True)
    ]
    if len(engines) == 1:
        # One engine's pooled figures are its own (the same stats, up to the same end):
        # computed once, not twice (the usage samples are one per step or jump).
        total = msgspec.structs.replace(workers[0], worker=None)
    else:
        total = worker_report(None, [engine.stats for engine in engines], simulated, final, sla=sla)
    return Report(
        workload=workload,
        settings=settings,
        wall_s=wall_s,
        simulated_s=simulated,
        requests_per_wall_s=total.requests_submitted / wall_s if wall_s > 0 else 0.0,
        workers=workers,
        total=total,
        sla=sla,
        max_sim_time_s=max_sim_time_s,
        requests_unfinished=unfinished,
        requests_unstarted=unstarted,
        routing=routing,
    )


def report_json(report: Report) -> bytes:
    """The report as indented JSON (UTF-8, trailing newline); ``routing`` only when a
    router dispatched (so a least-loaded or round-robin report reads as before)."""
    if report.routing is None:
        fields = msgspec.to_builtins(report)
        del fields["routing"]
        return msgspec.json.format(msgspec.json.encode(fields), indent=2) + b"\n"
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def latency_rows(columns: Sequence[WorkerReport]) -> list[tuple[str, list[str]]]:
    """Text rows of the ``vllm bench serve`` latencies, in ms: mean, p50, p90, p99 each."""
    rows: list[tuple[str, list[str]]] = []
    for label, name in (
        ("TTFT", "ttft_s"),
        ("TPOT", "tpot_s"),
        ("ITL", "itl_s"),
        ("end-to-end latency", "latency_s"),
    ):
        for stat in ("mean", "p50", "p90", "p99"):
            cells = [f"{1e3 * getattr(getattr(w, name), stat):.2f}" for w in columns]
            rows.append((f"{label} {stat} (ms)", cells))
    return rows


def format_report(report: Report) -> str:
    """The report as a plain-text table: one column per worker, then the total."""
    columns = [*report.workers, report.total] if len(report.workers) > 1 else [report.total]
    heads = [f"worker {w.worker}" for w in report.workers] if len(report.workers) > 1 else []
    heads.append("total")

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def secs(x: float) -> str:
        return f"{x:.3f}s"

    rows: list[tuple[str, list[str]]] = [
        ("requests submitted", [f"{w.requests_submitted}" for w in columns]),
        ("requests completed", [f"{w.requests_completed}" for w in columns]),
        ("requests rejected", [f"{w.requests_rejected}" for w in columns]),
        ("prompt tokens", [f"{w.prompt_tokens}" for w in columns]),
        ("generated tokens", [f"{w.generated_tokens}" for w in columns]),
        ("prefill tokens computed", [f"{w.prefill_tokens_computed}" for w in columns]),
        ("steps", [f"{w.steps}" for w in columns]),
        ("simulated time", [secs(w.simulated_s) for w in columns]),
        ("prefix cache hit rate", [pct(w.prefix_cache_hit_rate) for w in columns]),
        (
            "  hits / queries (tokens)",
            [f"{w.prefix_cache_hits}/{w.prefix_cache_queries}" for w in columns],
        ),
        ("KV usage mean", [pct(w.kv_usage.mean) for w in columns]),
        ("KV usage p50", [pct(w.kv_usage.p50) for w in columns]),
        ("KV usage p99", [pct(w.kv_usage.p99) for w in columns]),
        ("KV usage max", [pct(w.kv_usage.max) for w in columns]),
        ("preemptions", [f"{w.preemptions}" for w in columns]),
        ("evictions (blocks)", [f"{w.evictions}" for w in columns]),
        *latency_rows(columns),
        ("output tokens per second", [f"{w.output_tokens_per_s:.1f}" for w in columns]),
        ("KV event batches", [f"{w.kv_event_batches}" for w in columns]),
        ("leaked blocks", [f"{w.leaked_blocks}" for w in columns]),
        *goodput_rows(report.sla, columns),
    ]
    label_width = max(len(label) for label, _ in rows)
    widths = [
        max(len(head), *(len(values[i]) for _, values in rows)) for i, head in enumerate(heads)
    ]
    lines = [
        f"kvpool simulate: {report.workload}",
        f"wall time {report.wall_s:.2f}s, simulated {report.simulated_s:.2f}s, "
        f"{report.requests_per_wall_s:.0f} requests per wall second",
        "",
        " " * label_width
        + "  "
        + "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)),
    ]
    for label, values in rows:
        cells = "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        lines.append(f"{label.ljust(label_width)}  {cells}")
    if report.routing is not None:
        lines.extend(routing_lines(report.routing))
    if report.max_sim_time_s is not None:
        lines.append(
            f"cut at {report.max_sim_time_s:g}s simulated (--max-sim-time-s): "
            f"{report.requests_unfinished} requests unfinished (aborted in flight), "
            f"{report.requests_unstarted} unstarted"
        )
    return "\n".join(lines) + "\n"


def goodput_rows(sla: Sla | None, columns: Sequence[WorkerReport]) -> list[tuple[str, list[str]]]:
    """Text rows of the goodput figures (none without an SLA)."""
    if sla is None:
        return []
    targets = ", ".join(
        f"{name} <= {value:g} ms"
        for name, value in (("TTFT", sla.ttft_ms), ("ITL", sla.itl_ms), ("E2E", sla.e2e_ms))
        if value is not None
    )
    good = [w.goodput for w in columns if w.goodput is not None]
    return [
        (f"goodput requests ({targets})", [f"{g.goodput_completed_requests}" for g in good]),
        ("goodput requests per second", [f"{g.goodput_request_throughput_rps:.3f}" for g in good]),
        ("goodput output tokens per s", [f"{g.goodput_output_throughput_tok_s:.1f}" for g in good]),
    ]
