"""Where a trace's lines come from: a file, a gzip file, or standard input (``-``).

Lines are read one at a time (what the caller keeps of them is its own choice). A gzip
file is known by its magic bytes, whatever its name.
"""

from __future__ import annotations

import gzip
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvpool.errors import TraceError

STDIN = "-"
"""The trace path that means standard input."""

_GZIP_MAGIC = b"\x1f\x8b"


def source_name(path: str | Path) -> str:
    """How errors name the trace: its path, or ``<stdin>``."""
    return "<stdin>" if str(path) == STDIN else str(path)


@contextmanager
def open_lines(path: str | Path | IO[bytes]) -> Iterator[Iterator[bytes]]:
    """The lines of a trace (a path, or an open binary file read from where it is),
    gunzipped if it is gzip; `TraceError` if it cannot be opened or read."""
    source = source_name(path) if isinstance(path, str | Path) else "<trace>"
    try:
        with _open(path) as raw, _maybe_gunzip(raw) as lines:
            yield iter(lines)
    except OSError as exc:  # gzip.BadGzipFile included
        raise TraceError(f"cannot read the trace: {exc.strerror or exc}", source=source) from exc
    except EOFError as exc:  # a truncated gzip stream
        raise TraceError(f"cannot read the trace: {exc}", source=source) from exc


@contextmanager
def _open(path: str | Path | IO[bytes]) -> Iterator[IO[bytes]]:
    if not isinstance(path, str | Path):
        yield path  # the caller's: not ours to close
        return
    if str(path) == STDIN:
        yield sys.stdin.buffer
        return
    with open(path, "rb") as file:
        yield file


@contextmanager
def _maybe_gunzip(raw: IO[bytes]) -> Iterator[IO[bytes]]:
    head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if not head and raw.seekable():
        position = raw.tell()
        head = raw.read(2)
        raw.seek(position)
    if head == _GZIP_MAGIC:
        with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
            yield unzipped  # type: ignore[misc]
        return
    yield raw
