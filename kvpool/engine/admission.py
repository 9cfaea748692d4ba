"""Whether a request could ever run on an engine: a pure function of its config.

`MockEngine.submit` rejects what `rejection_reason` names; serve's intake asks it too, of
the config alone, so a handler never calls into an engine another task owns.

setup.py compiles this module with mypyc: the engine asks once a request.
"""

from __future__ import annotations

from kvpool.engine.config import EngineConfig
from kvpool.workloads import RequestSpec


def rejection_reason(config: EngineConfig, spec: RequestSpec) -> str | None:
    """Why ``spec`` could never run on an engine with ``config``, or None if it can."""
    limit = config.max_model_len
    output_length = spec.output.length  # `RequestSpec.output_length`, without its call
    if limit is not None and spec.input_length + output_length > limit:
        return (
            f"holds {spec.input_length} prompt and {output_length} output tokens, "
            f"more than max_model_len {limit}"
        )
    # The last output token is sampled, never computed: it needs no KV slot.
    max_tokens = spec.input_length + output_length - 1
    blocks = -(-max_tokens // config.block_size)
    if blocks > config.num_gpu_blocks:
        return f"needs {blocks} blocks, the pool holds {config.num_gpu_blocks}"
    if not config.enable_chunked_prefill and max_tokens > config.max_num_batched_tokens:
        return (
            f"needs {max_tokens} tokens in one step without chunked prefill, the "
            f"budget is {config.max_num_batched_tokens}"
        )
    return None
