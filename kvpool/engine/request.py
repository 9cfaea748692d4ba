"""A request as the engine's scheduler sees it: token counts, block count, timestamps.

Compiled with mypyc (setup.py) with the engine's per-step modules (`kvpool.engine.scheduler`,
`kvpool.engine.work`, `kvpool.engine.execution`, `kvpool.engine.fast_forward`), which read
and write these fields for every running request every step; it runs interpreted just the
same.
"""

from __future__ import annotations

from kvpool.engine.record import RequestRecord
from kvpool.workloads import RequestSpec
from kvpool.workloads.tokens import segment_span


class EngineRequest:
    """One admitted request's scheduling state.

    ``num_tokens`` counts the prompt plus every generated token; ``num_computed`` the
    tokens whose KV is computed (``<= num_tokens``); ``num_blocks`` the blocks its table
    holds, as the allocations reported them. Preemption resets ``num_computed`` and
    ``num_blocks`` to 0 and keeps the tokens. The manager is told the generated tokens
    only when it needs them (before an allocation, a watermark move or a preemption): a
    partial block has no hash, so it loses nothing by waiting. ``num_sent`` counts the
    output tokens it has; `take_pending` builds the others (the output is a pure function of
    the spec), so a decode step stores no token.
    ``first_scheduled_s``, ``cached_tokens`` (summed over admissions) and
    ``last_token_s`` (for the inter-token gaps) feed its `RequestRecord`.
    ``registered`` turns true when the KV manager first hears of it (its first admission
    call registers it: `MockEngine._admit`), not when it queues.
    ``prompt_length``, ``output_length`` and ``output_seed`` are the spec's, copied once
    as machine words: the per-step loops read them for every running request, and
    through the spec each read is two attribute lookups on interpreted objects.
    """

    __slots__ = (
        "arrival_s",
        "cached_tokens",
        "finish_s",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "num_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "num_sent",
        "num_tokens",
        "output_length",
        "output_seed",
        "prompt_length",
        "registered",
        "request_id",
        "spec",
    )

    def __init__(self, spec: RequestSpec, arrival_s: float) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.arrival_s = arrival_s
        self.prompt_length = spec.input_length
        output = spec.output
        self.output_length = output.length
        self.output_seed = output.seed
        self.num_tokens = self.prompt_length
        self.num_computed = 0
        self.num_blocks = 0
        self.num_output = 0
        self.num_preemptions = 0
        self.num_sent = 0  # output tokens the KV manager has been told
        self.registered = False
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.finish_s: float | None = None
        self.cached_tokens = 0

    @property
    def is_decoding(self) -> bool:
        """True if the request has sampled a token and computed every token but the one
        it sampled last: its next step computes that one token, a decode (or, after a
        preemption, the last token of its recomputation, which costs the same)."""
        return self.num_output > 0 and self.num_computed + 1 == self.num_tokens

    @property
    def has_pending(self) -> bool:
        """True if the request generated tokens the KV manager has not been told."""
        return self.num_sent < self.num_tokens - self.prompt_length

    def take_pending(self) -> range | list[int]:
        """The generated tokens the KV manager has not been told, now counted as told: a
        ``range`` (a run: no token is built unless the manager keeps tokens), or the
        list when the ids wrap past ``2**32``."""
        start, self.num_sent = self.num_sent, self.num_tokens - self.prompt_length
        return segment_span(self.output_seed, self.output_length, start, self.num_sent)

    def record(self, worker: int, *, rejected: bool = False) -> RequestRecord:
        """The request's `RequestRecord` as of now."""
        return RequestRecord(
            request_id=self.request_id,
            worker=worker,
            arrival_s=self.arrival_s,
            first_scheduled_s=self.first_scheduled_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s,
            prompt_tokens=self.prompt_length,
            output_tokens=self.output_length,
            cached_tokens=self.cached_tokens,
            preemptions=self.num_preemptions,
            rejected=rejected,
        )

    def __repr__(self) -> str:
        return (
            f"EngineRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={self.num_blocks}, output={self.num_output})"
        )
