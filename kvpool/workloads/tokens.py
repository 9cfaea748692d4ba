"""The token ids a workload's segments stand for, as one compiled function.

setup.py compiles this module with mypyc: the engine's step bookkeeping (compiled too)
builds each decode step's generated tokens with a direct native call. It runs
interpreted just the same.
"""

from __future__ import annotations

TOKEN_MASK = (1 << 32) - 1
"""Token ids are u32."""


def segment_tokens(seed: int, length: int, start: int, stop: int) -> list[int]:
    """Token ids ``[start, min(stop, length))`` of the segment (``seed``, ``length``):
    token ``j`` is ``(seed + j) mod 2**32``."""
    seed &= TOKEN_MASK
    end = min(stop, length)
    if seed + end <= TOKEN_MASK:
        return list(range(seed + start, seed + end))
    return [(seed + j) & TOKEN_MASK for j in range(start, end)]


__all__ = ["TOKEN_MASK", "segment_tokens"]
