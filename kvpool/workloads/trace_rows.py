"""One Mooncake trace line's request: its fields checked and made a `RequestSpec`.

This is the per-line work of reading a trace (`kvpool.workloads.mooncake` decodes the
line and names the bad ones); setup.py compiles this module with mypyc, since a run
reads every line of its trace once more while it simulates. It runs interpreted just
the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from kvpool.errors import TraceError
from kvpool.workloads.spec import RequestSpec, Segment, seed_mixer

MAX_TIMESTAMP_MS: Final = 1e12
"""Latest timestamp a trace may hold: about 31.7 years. Beyond it the simulated clock (a
float of seconds) could no longer resolve a microsecond step."""

MAX_TRACE_TOKENS: Final = 1 << 30
"""Longest prompt or output a trace may ask for (about a billion tokens, a thousand times
today's longest context windows): more is a corrupt line, not a request."""

SEGMENTS_HELD: Final = 1 << 16
"""Most whole-block segments a reader's cache holds (then it starts afresh)."""

_ID_BITS: Final = 64
_OUTPUT_DOMAIN: Final = 2  # keeps output seeds apart from prompt seeds (domain 1)
_output_seed = seed_mixer(_OUTPUT_DOMAIN)  # mix_seed(_OUTPUT_DOMAIN, line number)


def line_request(
    timestamp: int | float,
    input_length: int,
    output_length: int,
    ids: list[int],
    source: str,
    number: int,
    block_size: int,
    whole: dict[int, Segment],
    segment: Callable[[int, int], Segment],
) -> RequestSpec:
    """The request of line ``number`` of ``source``: ``timestamp`` ms, a prompt of
    ``input_length`` tokens named by one hash id per ``block_size`` tokens, an output
    of ``output_length``; `TraceError` naming the line if one of them is out of range.

    ``whole`` maps a hash id to its whole block's segment, made by ``segment(id,
    length)`` when it is missing (and cleared past `SEGMENTS_HELD`), which also makes a
    partial last block's. What RequestSpec's construction checks is checked here, and the
    prompt holds ``input_length`` tokens, so the spec is made by `RequestSpec.checked`.
    """
    if isinstance(timestamp, bool) or not math.isfinite(timestamp):
        raise _fail(f"timestamp must be a finite number of ms, got {timestamp!r}", source, number)
    if timestamp < 0:
        raise _fail(f"timestamp must be >= 0 ms, got {timestamp}", source, number)
    if timestamp > MAX_TIMESTAMP_MS:
        raise _fail(
            f"timestamp must be <= {MAX_TIMESTAMP_MS:.0e} ms (31 years), got {timestamp}",
            source,
            number,
        )
    for name, length in (("input_length", input_length), ("output_length", output_length)):
        if length < 1:
            raise _fail(f"{name} must be >= 1, got {length}", source, number)
        if length > MAX_TRACE_TOKENS:
            raise _fail(f"{name} must be <= 2**30 tokens, got {length}", source, number)
    expected = -(-input_length // block_size)
    if len(ids) != expected:
        raise _fail(
            f"hash_ids holds {len(ids)} ids but input_length "
            f"{input_length} needs {expected} (one per {block_size} tokens; "
            "see --trace-block-size)",
            source,
            number,
        )
    for hash_id in ids:  # not empty: input_length >= 1
        # bit_length, not a comparison with 2**64 - 1: compiled, that boxes the constant
        if hash_id < 0 or hash_id.bit_length() > _ID_BITS:
            raise _fail(f"hash_ids must be ints in [0, 2**64), got {hash_id}", source, number)
    if len(whole) > SEGMENTS_HELD:
        whole.clear()
    # Every block but the last is whole.
    last = input_length - (expected - 1) * block_size
    prompt: list[Segment] = []
    for i in range(expected if last == block_size else expected - 1):
        hash_id = ids[i]
        known = whole.get(hash_id)
        if known is None:
            known = whole[hash_id] = segment(hash_id, block_size)
        prompt.append(known)
    if last != block_size:
        prompt.append(segment(ids[-1], last))
    return RequestSpec.checked(
        f"line-{number}",
        timestamp / 1000.0,
        tuple(prompt),
        Segment(_output_seed(number), output_length),
        input_length,
    )


def _fail(message: str, source: str, number: int) -> TraceError:
    return TraceError(message, source=source, line=number)
