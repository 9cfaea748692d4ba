"""Mooncake trace input: JSON lines of timestamped requests whose blocks are named by ids.

Each line is an object with exactly ``timestamp`` (ms, >= 0), ``input_length`` (>= 1),
``output_length`` (>= 1) and ``hash_ids``: one id per ``trace_block_size`` tokens of
the prompt (512 in the published Mooncake traces), the last block possibly partial. An
id names a block *with its whole prefix*, so equal ids mean equal tokens: the prompt's
tokens are derived from its ids, and prefixes shared in the trace are shared in the cache
whatever the engine's block size.

The whole file is validated before any request is returned; the first bad line raises a
`TraceError` naming it. Requests are ordered by timestamp (stable for equal stamps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import msgspec

from kvpool.errors import TraceError
from kvpool.workloads.spec import RequestSpec, Segment, mix_seed

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the published Mooncake traces."""

_MAX_ID = (1 << 64) - 1
_PROMPT_DOMAIN = 1  # keeps prompt seeds apart from output seeds
_OUTPUT_DOMAIN = 2


class MooncakeRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a Mooncake trace, as written."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(MooncakeRecord)


def read_mooncake_trace(
    path: str | Path, *, trace_block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[RequestSpec]:
    """Read and validate a Mooncake trace file; raise `TraceError` on the first bad line.

    Also raises `TraceError` (with no line) when the file cannot be read or holds no
    request.
    """
    source = str(path)
    try:
        with open(path, "rb") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc.strerror or exc}", source=source) from exc
    return parse_mooncake_lines(lines, source=source, trace_block_size=trace_block_size)


def parse_mooncake_lines(
    lines: Iterable[bytes | str], *, source: str = "<trace>", trace_block_size: int = 512
) -> list[RequestSpec]:
    """Validate Mooncake lines (blank lines are skipped) and return their requests."""
    if type(trace_block_size) is not int or trace_block_size < 1:
        raise TraceError(
            f"trace block size must be an int >= 1, got {trace_block_size!r}", source=source
        )
    requests: list[RequestSpec] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _decode(line, source, number)
        requests.append(_to_request(record, source, number, trace_block_size))
    if not requests:
        raise TraceError("the trace holds no request", source=source)
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def _decode(line: bytes | str, source: str, number: int) -> MooncakeRecord:
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise TraceError(f"bad record: {exc}", source=source, line=number) from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"not a JSON object: {exc}", source=source, line=number) from None


def _to_request(record: MooncakeRecord, source: str, number: int, block_size: int) -> RequestSpec:
    def fail(message: str) -> TraceError:
        return TraceError(message, source=source, line=number)

    if isinstance(record.timestamp, bool) or not math.isfinite(record.timestamp):
        raise fail(f"timestamp must be a finite number of ms, got {record.timestamp!r}")
    if record.timestamp < 0:
        raise fail(f"timestamp must be >= 0 ms, got {record.timestamp}")
    if record.input_length < 1:
        raise fail(f"input_length must be >= 1, got {record.input_length}")
    if record.output_length < 1:
        raise fail(f"output_length must be >= 1, got {record.output_length}")
    expected = -(-record.input_length // block_size)
    if len(record.hash_ids) != expected:
        raise fail(
            f"hash_ids holds {len(record.hash_ids)} ids but input_length "
            f"{record.input_length} needs {expected} (one per {block_size} tokens; "
            "see --trace-block-size)"
        )
    for hash_id in record.hash_ids:
        if not 0 <= hash_id <= _MAX_ID:
            raise fail(f"hash_ids must be ints in [0, 2**64), got {hash_id}")
    last = record.input_length - (expected - 1) * block_size
    prompt = tuple(
        Segment(mix_seed(_PROMPT_DOMAIN, hash_id), block_size if i < expected - 1 else last)
        for i, hash_id in enumerate(record.hash_ids)
    )
    return RequestSpec(
        request_id=f"line-{number}",
        arrival_s=record.timestamp / 1000.0,
        prompt=prompt,
        output=Segment(mix_seed(_OUTPUT_DOMAIN, number), record.output_length),
    )
