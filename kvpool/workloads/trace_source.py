"""Where a trace's lines come from: a file, a gzip file, or standard input (``-``).

Lines are read one at a time, so a trace is never held whole. A gzip file is known by
its magic bytes, whatever its name. Standard input can be read only once, so
`spool_stdin` copies it to an anonymous temporary file that can be read again.
"""

from __future__ import annotations

import gzip
import io
import sys
import tempfile
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


def spool_stdin() -> IO[bytes]:
    """Copy standard input to a temporary file (deleted when closed), rewound."""
    spool = tempfile.TemporaryFile()  # noqa: SIM115 (returned open; the caller closes it)
    try:
        stdin = sys.stdin.buffer
        # read1: one read per call, so the first end of file ends the copy (a terminal's
        # Ctrl-D is not sticky: a buffered read(n) would wait for a second one)
        read = stdin.read1 if isinstance(stdin, io.BufferedIOBase) else stdin.read
        while chunk := read(1 << 20):
            spool.write(chunk)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool


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
