"""Raw HTTP/1.1 on loopback sockets, for the serve tests that need what a client library
hides: leaving mid-stream, half-closing, stalling, leaving mid-upload."""

from __future__ import annotations

import asyncio
import json
from typing import Any


def request_bytes(path: str, body: dict[str, Any] | bytes, *, extra: bytes = b"") -> bytes:
    """A POST with a JSON body (``Connection: close``); ``extra`` adds header lines."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n%s\r\n%s"
        % (path.encode(), len(data), extra, data)
    )


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def read_head(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status code and the header block of a response."""
    head = await reader.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    """Everything up to and including ``marker`` (raises at EOF without it)."""
    return await reader.readuntil(marker)


async def drop(writer: asyncio.StreamWriter) -> None:
    """Leave: close the socket at once (the server sees the connection lost)."""
    writer.transport.abort()
    await asyncio.sleep(0)
