"""The `RequestRecord` a request leaves behind once it has finished or been rejected."""

from __future__ import annotations

import msgspec


class RequestRecord(msgspec.Struct, frozen=True, gc=False):
    """One request's life, as ``--requests-jsonl`` writes it (times in simulated seconds).

    ``first_scheduled_s`` is the start of the first step that scheduled it,
    ``first_token_s`` and ``finish_s`` the ends of the steps that sampled its first and
    last token; all three are None for a rejected request. ``prompt_tokens`` and
    ``output_tokens`` are its lengths as the workload gives them. ``cached_tokens`` sums
    the cached prefix each admission reused, re-admissions after preemption included, so
    a worker's records add up to its ``prefix_cache_hits`` (vLLM's ``num_cached_tokens``
    counts the first admission only; the two agree for a request never preempted).
    """

    request_id: str
    worker: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    preemptions: int
    rejected: bool
