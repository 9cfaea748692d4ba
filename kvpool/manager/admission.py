"""vLLM 0.33's admission check of one queued request, in plain ints: the check the
manager's waiting loop (`KvManager.schedule`) makes with an `AdmissionGate`'s inputs,
kept in locals as the loop moves on, and the engine makes itself when it knows the
head's cost. setup.py compiles this module with mypyc.
"""

from __future__ import annotations


def admit_blocks(
    cached_blocks: int,
    active_cached_blocks: int,
    num_tokens: int,
    block_size: int,
    budget: int,
    headroom: int,
    watermark: int,
    running: int,
    chunked: bool,
    full_sequence: bool,
) -> tuple[int, int, int, int] | None:
    """What admitting a request of ``num_tokens`` tokens whose first ``cached_blocks``
    are cached (``active_cached_blocks`` of them in use) takes within ``budget`` tokens
    and ``headroom`` blocks while ``running`` requests run: (cached tokens, new tokens
    this step, fresh blocks, inactive cached blocks it pins); None if it must wait.

    vLLM's check (``allocate_slots``, its ``full_sequence_must_fit`` gate first): the
    fresh blocks (of the whole sequence with ``full_sequence``; else of this step's
    chunk, ``budget`` tokens at most when ``chunked``, else the whole prompt or nothing)
    plus the inactive cached prefix the allocation takes out of the free queue, plus
    the ``watermark`` blocks while some request runs (vLLM's ``has_scheduled_reqs``),
    must fit in ``headroom``. A whole sequence needs at least its chunk's blocks, so the chunk's
    own check, which vLLM makes next, never refuses what this one admits. Without the
    full-sequence gate and the watermark it is exact: the allocation fails exactly when
    it refuses.
    """
    inactive_cached = cached_blocks - active_cached_blocks
    cached = cached_blocks * block_size
    num_new = num_tokens - cached
    if num_new > budget:
        if not chunked:
            return None
        num_new = budget
    fresh = -(-(cached + num_new) // block_size) - cached_blocks
    required = fresh + inactive_cached
    if full_sequence:
        required += -(-num_tokens // block_size) - cached_blocks - fresh
    if running:
        required += watermark
    if required > headroom:
        return None
    return cached, num_new, fresh, inactive_cached
