"""The token ids a workload's segments stand for: the formula's one statement.

setup.py compiles this module with mypyc: the engine's step bookkeeping (compiled too)
builds each decode step's generated tokens with a direct native call, and a prompt's
new segments are built as arrays without a Python int per token. It runs interpreted
just the same.
"""

from __future__ import annotations

import sys
from array import array
from typing import Final

from kvpool.hashing import TOKEN_TYPECODE

TOKEN_MASK: Final = (1 << 32) - 1
"""Token ids are u32."""
_RUN_MAX: Final = 4096  # longest run `segment_token_array` builds arithmetically
_RAMP = array(TOKEN_TYPECODE, range(_RUN_MAX)).tobytes()  # 0, 1, 2, ... as native u32
_ONES = array(TOKEN_TYPECODE, [1] * _RUN_MAX).tobytes()
_LITTLE: Final = sys.byteorder == "little"


def segment_tokens(seed: int, length: int, start: int, stop: int) -> list[int]:
    """Token ids ``[start, min(stop, length))`` of the segment (``seed``, ``length``):
    token ``j`` is ``(seed + j) mod 2**32``."""
    seed &= TOKEN_MASK
    end = min(stop, length)
    if seed + end <= TOKEN_MASK:
        return list(range(seed + start, seed + end))
    return [(seed + j) & TOKEN_MASK for j in range(start, end)]


def segment_span(seed: int, length: int, start: int, stop: int) -> range | list[int]:
    """`segment_tokens` as a ``range`` when the ids do not wrap past ``2**32`` (the
    common case: no token is built; a manager takes a range as a run), else as the list."""
    seed &= TOKEN_MASK
    end = min(stop, length)
    if seed + end <= TOKEN_MASK + 1:
        return range(seed + start, seed + max(start, end))
    return segment_tokens(seed, length, start, stop)


def segment_token_array(seed: int, length: int) -> array[int]:
    """All of a segment's tokens, as `segment_tokens` gives them, in a ``u32`` array.

    A run of consecutive u32 ``seed .. seed + n - 1`` is, read as one little-endian
    integer of ``n`` words, ``seed * (1 + 2**32 + 2**64 + ...) + (0 + 1 * 2**32 + 2 *
    2**64 + ...)``: two big-integer operations in C, against building ``n`` Python ints
    (4x faster at 512 tokens). Runs that wrap past ``2**32``, longer than 4,096 tokens or
    on a big-endian host take the token-by-token path.
    """
    seed &= TOKEN_MASK
    tokens = array(TOKEN_TYPECODE)
    if not _LITTLE or length > _RUN_MAX or seed + length > TOKEN_MASK + 1 or length <= 0:
        tokens.extend(segment_tokens(seed, length, 0, length))
        return tokens
    size = 4 * length
    ones = int.from_bytes(_ONES[:size], "little")
    ramp = int.from_bytes(_RAMP[:size], "little")
    tokens.frombytes((seed * ones + ramp).to_bytes(size, "little"))
    return tokens


def segment_runs(segments: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The token runs ``(start, length)`` of segments ``(seed, length)``, the empty ones
    left out: a prompt as `kvpool.hashing.TokenRuns` holds it (built once per request
    the manager hears of; compiled, a segment is read as a tuple, not by attribute)."""
    runs: list[tuple[int, int]] = []
    for segment in segments:
        length = segment[1]
        if length:
            runs.append((segment[0] & TOKEN_MASK, length))
    return tuple(runs)


__all__ = ["TOKEN_MASK", "segment_runs", "segment_span", "segment_token_array", "segment_tokens"]
