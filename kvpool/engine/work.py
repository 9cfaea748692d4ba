"""What a step computes (`StepWork`), counted from its scheduled requests: the timing
models' input. setup.py compiles this module with mypyc (it runs every step)."""

from __future__ import annotations

from kvpool.engine.request import EngineRequest
from kvpool.engine.timing import StepWork


def step_work(
    scheduled: dict[EngineRequest, int], active_blocks: int, capacity: int, block_size: int
) -> StepWork:
    """What the scheduled requests compute this step, as the timing models read it."""
    prefill_tokens = decode_seqs = 0
    prefill_requests = prompt_start = prompt_end = emitting = context_tokens = 0
    decoding = decode_context = 0
    for request, num_new in scheduled.items():
        before = request.num_computed
        tokens = request.num_tokens
        if num_new == 1 and request.is_decoding:
            decode_seqs += 1
        else:
            prefill_tokens += num_new
        prompt = request.prompt_length
        if before < prompt:  # prompt tokens computed (Dynamo's prefill batch)
            prefill_requests += 1
            prompt_start += before
            prompt_end += min(before + num_new, prompt)
        if before + num_new == tokens:  # samples a token this step
            emitting += 1
            context_tokens += tokens
            if request.num_output:  # and sampled before: decoding, or done recomputing
                decoding += 1
                decode_context += tokens
    return StepWork(
        prefill_tokens=prefill_tokens,
        decode_seqs=decode_seqs,
        prefill_requests=prefill_requests,
        prompt_start=prompt_start,
        prompt_end=prompt_end,
        emitting=emitting,
        context_tokens=context_tokens,
        decoding=decoding,
        decode_context_tokens=decode_context,
        active_blocks=active_blocks,
        capacity=capacity,
        block_size=block_size,
    )


def decode_work(
    requests: int, context_tokens: int, active_blocks: int, capacity: int, block_size: int
) -> StepWork:
    """What a step in which each of ``requests`` running requests decodes one token
    computes, as the timing models read it."""
    return StepWork(
        decode_seqs=requests,
        emitting=requests,
        context_tokens=context_tokens,
        decoding=requests,
        decode_context_tokens=context_tokens,
        active_blocks=active_blocks,
        capacity=capacity,
        block_size=block_size,
    )
