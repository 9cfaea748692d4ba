"""Mooncake trace input: JSON lines of timestamped requests whose blocks are named by ids.

Each line is an object with exactly ``timestamp`` (ms, >= 0), ``input_length`` (>= 1),
``output_length`` (>= 1) and ``hash_ids``: one id per ``trace_block_size`` tokens of
the prompt (512 in the published Mooncake traces), the last block possibly partial. An
id names a block *with its whole prefix*, so equal ids mean equal tokens: the prompt's
tokens are derived from its ids, and prefixes shared in the trace are shared in the cache
whatever the engine's block size.

The whole file is validated before any request is returned; the first bad line raises a
`TraceError` naming it. A trace that uses one hash id for blocks of two sizes (a
request's partial last block, and the same id full in a later request) is run as it is
(the partial block is the full one's first tokens) but warned about (`TraceWarning`,
naming the first such line): a Mooncake id must stand for one block of fixed content,
and NVIDIA's aiperf refuses such a trace. Requests are ordered by timestamp (stable for
equal stamps). Absurd values are bad lines too: a timestamp beyond `MAX_TIMESTAMP_MS` or a length
beyond `MAX_TRACE_TOKENS` (a request merely larger than an engine's pool is not: the
engine rejects it and the report counts it).

`MooncakeTrace` reads the file once: the pass that validates it builds every request,
and the trace holds them (about 400 bytes a request), rather than parsing each line
again when a run iterates it (which cost a run on the multi-turn benchmark trace 6-9%
of its time).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

import msgspec

from kvpool.errors import TraceError
from kvpool.workloads.spec import RequestSpec, Segment, mix_seed
from kvpool.workloads.trace_rows import MAX_TIMESTAMP_MS as MAX_TIMESTAMP_MS
from kvpool.workloads.trace_rows import MAX_TRACE_TOKENS as MAX_TRACE_TOKENS
from kvpool.workloads.trace_rows import line_request
from kvpool.workloads.trace_source import open_lines, source_name

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the published Mooncake traces."""

_PROMPT_DOMAIN = 1  # keeps prompt seeds apart from output seeds (domain 2)


class MooncakeRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a Mooncake trace, as written."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(MooncakeRecord)


class TraceWarning(UserWarning):
    """A trace kvpool runs but other tools refuse: a hash id used at two block sizes."""


class _BlockSizes:
    """Finds the first line whose hash id stands for a block of another size than where
    it was used before. Keeps one entry per distinct id until it finds one, then
    nothing: only the first such line is named."""

    __slots__ = ("_block_size", "_seen", "found")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._seen: dict[int, tuple[int, int]] | None = {}  # id -> (tokens, first line)
        self.found: str | None = None

    def see(self, record: MooncakeRecord, number: int) -> None:
        seen = self._seen
        if seen is None:
            return
        ids = record.hash_ids
        block_size = self._block_size
        last = len(ids) - 1
        for i, hash_id in enumerate(ids):
            tokens = block_size if i < last else record.input_length - last * block_size
            before = seen.setdefault(hash_id, (tokens, number))
            if before[0] != tokens:
                self.found = (
                    f"line {number}: hash id {hash_id} stands for a block of {tokens} tokens, "
                    f"and of {before[0]} at line {before[1]}: a Mooncake hash id must name "
                    "one block of one size (aiperf refuses this trace; kvpool runs it, the "
                    "shorter block as the longer one's first tokens)"
                )
                self._seen = None
                return

    def warn(self, source: str) -> None:
        """Issue the `TraceWarning`, if a line was found, at the line that asked for the
        trace (`_parse` is called by `MooncakeTrace` or `parse_mooncake_lines`)."""
        if self.found is not None:
            warnings.warn(f"{source}: {self.found}", TraceWarning, stacklevel=4)


def read_mooncake_trace(
    path: str | Path, *, trace_block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[RequestSpec]:
    """Read and validate a Mooncake trace file; raise `TraceError` on the first bad line.

    Also raises `TraceError` (with no line) when the file cannot be read or holds no
    request.
    """
    with open_lines(path) as lines:
        return parse_mooncake_lines(
            lines, source=source_name(path), trace_block_size=trace_block_size
        )


def parse_mooncake_lines(
    lines: Iterable[bytes | str], *, source: str = "<trace>", trace_block_size: int = 512
) -> list[RequestSpec]:
    """Validate Mooncake lines (blank lines are skipped) and return their requests;
    warn (`TraceWarning`) if a hash id stands for blocks of two sizes."""
    return _parse(lines, source, trace_block_size)[0]


def _parse(
    lines: Iterable[bytes | str], source: str, trace_block_size: int
) -> tuple[list[RequestSpec], bool]:
    """`parse_mooncake_lines`' requests (stably sorted by timestamp), and whether the
    lines had them in that order already."""
    sizes = _BlockSizes(trace_block_size)
    requests = list(_iter_checked(lines, source, trace_block_size, sizes))
    if not requests:
        raise TraceError("the trace holds no request", source=source)
    sizes.warn(source)
    in_order = all(
        requests[i - 1].arrival_s <= requests[i].arrival_s for i in range(1, len(requests))
    )
    if not in_order:
        requests.sort(key=lambda request: request.arrival_s)
    return requests, in_order


def iter_mooncake_lines(
    lines: Iterable[bytes | str], *, source: str = "<trace>", trace_block_size: int = 512
) -> Iterator[RequestSpec]:
    """Validate and yield the requests of Mooncake lines one by one, in file order
    (blank lines are skipped); `TraceError` at the first bad line."""
    yield from _iter_checked(lines, source, trace_block_size, None)


def _iter_checked(
    lines: Iterable[bytes | str], source: str, trace_block_size: int, sizes: _BlockSizes | None
) -> Iterator[RequestSpec]:
    """`iter_mooncake_lines`, each record also shown to ``sizes``."""
    if type(trace_block_size) is not int or trace_block_size < 1:
        raise TraceError(
            f"trace block size must be an int >= 1, got {trace_block_size!r}", source=source
        )
    for number, line in enumerate(lines, start=1):
        if not line or line.isspace():  # blank: what strip() would empty, not copied
            continue
        record = _decode(line, source, number)
        request = _to_request(record, source, number, trace_block_size)
        if sizes is not None:
            sizes.see(record, number)
        yield request


class MooncakeTrace:
    """A Mooncake trace file, read and validated whole at construction, its requests held.

    Construction reads the trace once (``path`` ``-``: standard input) and raises
    `TraceError` at the first bad line, so a run that starts never meets one (and warns,
    `TraceWarning`, if a hash id stands for two block sizes). The requests that pass
    builds are kept, in timestamp order (stably sorted when the file is not in order),
    and each iteration yields them again; ``len`` is their count. Close it (or use it as
    a context manager) to drop them.
    """

    def __init__(self, path: str | Path, *, trace_block_size: int = MOONCAKE_BLOCK_SIZE) -> None:
        self.path = path
        self.source = source_name(path)
        self.trace_block_size = trace_block_size
        with open_lines(path) as lines:
            self._requests, self._in_order = _parse(lines, self.source, trace_block_size)
        self._count = len(self._requests)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self._requests)

    def __enter__(self) -> MooncakeTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def in_order(self) -> bool:
        """True when the file's timestamps never go backwards (it needed no sort)."""
        return self._in_order

    def close(self) -> None:
        """Drop the held requests (iterating yields nothing after)."""
        self._requests = []


def _decode(line: bytes | str, source: str, number: int) -> MooncakeRecord:
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise TraceError(f"bad record: {exc}", source=source, line=number) from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"not a JSON object: {exc}", source=source, line=number) from None


@lru_cache(maxsize=1 << 16)
def _prompt_segment(hash_id: int, length: int) -> Segment:
    """The segment a trace's ``hash_id`` stands for: requests repeat their ids (a
    conversation's history), so they share one immutable `Segment` each."""
    return Segment(mix_seed(_PROMPT_DOMAIN, hash_id), length)


_whole_blocks: dict[int, dict[int, Segment]] = {}  # by trace block size: id -> segment


def _to_request(record: MooncakeRecord, source: str, number: int, block_size: int) -> RequestSpec:
    whole = _whole_blocks.get(block_size)
    if whole is None:
        whole = _whole_blocks[block_size] = {}
    return line_request(
        record.timestamp,
        record.input_length,
        record.output_length,
        record.hash_ids,
        source,
        number,
        block_size,
        whole,
        _prompt_segment,
    )
