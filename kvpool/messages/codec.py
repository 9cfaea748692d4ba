"""The protocol as one tagged union, with a msgpack encoder and decoder built once."""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvpool import errors
from kvpool.messages.replies import ErrorReply, Reply
from kvpool.messages.requests import Request

Message: TypeAlias = Request | Reply
"""Any message of the pool protocol."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Serialize ``message`` to msgpack (its tag names its kind)."""
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Parse msgpack produced by `encode`; raises ``msgspec.ValidationError`` if malformed."""
    return _decoder.decode(data)


def error_reply(exc: errors.PoolError) -> ErrorReply:
    """The wire form of a refused request."""
    return ErrorReply(type(exc).__name__, str(exc))


def error_from_reply(reply: ErrorReply) -> errors.PoolError:
    """Rebuild the exception an `ErrorReply` names (a plain `PoolError` if unknown)."""
    cls = getattr(errors, reply.error, None)
    if isinstance(cls, type) and issubclass(cls, errors.PoolError):
        return cls(reply.message)
    return errors.PoolError(f"{reply.error}: {reply.message}")
