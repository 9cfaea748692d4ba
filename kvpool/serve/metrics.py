"""``GET /metrics``: vLLM's V1 Prometheus names and labels, fed by the engine tasks.

Every series carries ``model_name`` (the served model name) and ``engine`` (the rank),
as vLLM's do. Latency histograms are in *simulated* seconds (what a real engine's would
measure), with vLLM's bucket bounds. The legacy names routers still scrape
(``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_queries_total``,
``vllm:gpu_prefix_cache_hits_total``) carry the same values as their V1 counterparts.
Each server has its own registry, so several in one process never share a series.

Per finished request (vLLM's ``FinishedRequestStats``): ``request_prompt_tokens`` and
``request_generation_tokens`` (1-2-5 buckets up to the model length),
``request_prefill_time`` (first scheduled to first token), ``request_decode_time``
(first to last token), ``request_inference_time`` (first scheduled to last token) and
``request_time_per_output_token`` (decode time over the tokens after the first); per
step, ``iteration_tokens_total`` (prompt tokens computed plus tokens generated). The
legacy ``vllm:time_per_output_token_seconds`` carries the inter-token latencies, as it
did before vLLM renamed it. ``kvpool:injected_failures_total{type}`` counts the
failures `kvpool.serve.failures` injected (no vLLM counterpart).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvpool.engine import EngineConfig

_LABELS = ("model_name", "engine")
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FINISH_REASON_STRINGS``: it creates a ``vllm:request_success`` child per
reason and engine at start-up, so each series exists at 0 before its first request (a
dashboard's ``rate(...{finished_reason="abort"})`` has a series to read). The mock
finishes requests as ``stop``, ``length`` or ``abort`` only."""


class _Alias(Collector):
    """A histogram's series under a legacy name, copied when /metrics is read (so an
    observation costs nothing more)."""

    def __init__(self, source: Histogram, name: str, documentation: str) -> None:
        self._source = source
        self._name = name
        self._documentation = documentation

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            alias = Metric(self._name, self._documentation, "histogram")
            for sample in family.samples:
                suffix = sample.name[len(family.name) :]
                if suffix == "_created":  # the original's creation time, not a value
                    continue
                alias.add_sample(self._name + suffix, sample.labels, sample.value)
            yield alias


def tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServeMetrics:
    """The server's Prometheus registry and its vLLM-named metrics."""

    def __init__(self, model_name: str, config: EngineConfig, ranks: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", _LABELS,
            registry=r,
        )  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", _LABELS, registry=r
        )
        self.usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _LABELS,
            registry=r,
        )  # fmt: skip
        self.gpu_usage = Gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (legacy name).", _LABELS,
            registry=r,
        )  # fmt: skip
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", _LABELS, registry=r
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", _LABELS, registry=r
        )
        self.gpu_queries = Counter(
            "vllm:gpu_prefix_cache_queries", "GPU prefix cache queries (legacy name).",
            _LABELS, registry=r,
        )  # fmt: skip
        self.gpu_hits = Counter(
            "vllm:gpu_prefix_cache_hits", "GPU prefix cache hits (legacy name).", _LABELS,
            registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", _LABELS, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", _LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", _LABELS, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Successfully processed requests.",
            (*_LABELS, "finished_reason"), registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", _LABELS,
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", _LABELS,
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Time spent waiting in the queue, seconds.",
            _LABELS, buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        tokens = tokens_buckets(config.num_gpu_blocks * config.block_size)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _LABELS,
            buckets=tokens, registry=r,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            _LABELS, buckets=tokens, registry=r,
        )  # fmt: skip
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            _LABELS, buckets=_ITERATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", _LABELS,
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(
            _Alias(
                self.itl, "vllm:time_per_output_token_seconds",
                "Inter-token latency in seconds (legacy name).",
            )
        )  # fmt: skip
        self.inference = Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", _LABELS,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", _LABELS,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode = Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", _LABELS,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.injected_failures = Counter(
            "kvpool:injected_failures", "Failures injected by --failure-rate/--fail-first.",
            ("model_name", "type"), registry=r,
        )  # fmt: skip
        info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
            ("model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=r,
        )  # fmt: skip
        for rank in range(ranks):
            engine = str(rank)
            info.labels(
                model_name, engine, str(config.block_size), str(config.num_gpu_blocks),
                str(config.enable_prefix_caching),
            ).set(1)  # fmt: skip
            for metric in (self.running, self.waiting, self.usage, self.gpu_usage):
                metric.labels(model_name, engine).set(0)
            for counter in (
                self.queries, self.hits, self.gpu_queries, self.gpu_hits, self.preemptions,
                self.prompt_tokens, self.generation_tokens,
            ):  # fmt: skip
                counter.labels(model_name, engine)
            for reason in FINISH_REASONS:
                self.success.labels(model_name, engine, reason)

    def rank(self, rank: int) -> RankMetrics:
        """The series of one engine rank, bound to its labels once (a label lookup per
        observation would cost the engine task more than the observation itself)."""
        return RankMetrics(self, str(rank))

    def failure(self, kind: str) -> None:
        """Count one injected failure of ``kind``."""
        self.injected_failures.labels(self.model_name, kind).inc()

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class RankMetrics:
    """One rank's labelled children of the `ServeMetrics` series (same attribute names;
    ``success`` is the ``finished_reason="length"`` child, ``stopped`` the ``"stop"``
    one)."""

    __slots__ = (
        "decode", "e2e", "generation_tokens", "gpu_hits", "gpu_queries", "gpu_usage", "hits",
        "inference", "iteration_tokens", "itl", "preemptions", "prefill",
        "prompt_tokens", "queries", "queue", "request_generation_tokens",
        "request_prompt_tokens", "running", "stopped", "success", "tpot", "ttft", "usage",
        "waiting",
    )  # fmt: skip

    def __init__(self, metrics: ServeMetrics, engine: str) -> None:
        m, label = metrics, (metrics.model_name, engine)
        self.running: Gauge = m.running.labels(*label)
        self.waiting: Gauge = m.waiting.labels(*label)
        self.usage: Gauge = m.usage.labels(*label)
        self.gpu_usage: Gauge = m.gpu_usage.labels(*label)
        self.queries: Counter = m.queries.labels(*label)
        self.hits: Counter = m.hits.labels(*label)
        self.gpu_queries: Counter = m.gpu_queries.labels(*label)
        self.gpu_hits: Counter = m.gpu_hits.labels(*label)
        self.preemptions: Counter = m.preemptions.labels(*label)
        self.prompt_tokens: Counter = m.prompt_tokens.labels(*label)
        self.generation_tokens: Counter = m.generation_tokens.labels(*label)
        self.success: Counter = m.success.labels(*label, "length")
        self.ttft: Histogram = m.ttft.labels(*label)
        self.itl: Histogram = m.itl.labels(*label)
        self.e2e: Histogram = m.e2e.labels(*label)
        self.queue: Histogram = m.queue.labels(*label)
        self.stopped: Counter = m.success.labels(*label, "stop")
        self.request_prompt_tokens: Histogram = m.request_prompt_tokens.labels(*label)
        self.request_generation_tokens: Histogram = m.request_generation_tokens.labels(*label)
        self.iteration_tokens: Histogram = m.iteration_tokens.labels(*label)
        self.tpot: Histogram = m.tpot.labels(*label)
        self.inference: Histogram = m.inference.labels(*label)
        self.prefill: Histogram = m.prefill.labels(*label)
        self.decode: Histogram = m.decode.labels(*label)

    def finished(
        self,
        *,
        arrival: float,
        scheduled: float,
        first_token: float,
        last_token: float,
        prompt_tokens: int,
        generation_tokens: int,
        reason: str = "length",
    ) -> None:
        """A request's end, as vLLM's ``update_from_finished_request`` records it (times
        in simulated seconds)."""
        (self.stopped if reason == "stop" else self.success).inc()
        self.e2e.observe(last_token - arrival)
        decode = last_token - first_token
        self.prefill.observe(first_token - scheduled)
        self.decode.observe(decode)
        self.inference.observe(last_token - scheduled)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.tpot.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)


__all__ = ["FINISH_REASONS", "RankMetrics", "ServeMetrics", "tokens_buckets"]
