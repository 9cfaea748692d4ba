"""msgpack encoding of `KVEventBatch`: vLLM's payload bytes, one encoder/decoder reused."""

from __future__ import annotations

import msgspec

from kvpool.events.types import KVEventBatch

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Return ``batch`` as msgpack bytes, byte-identical to vLLM's ``KVEventBatch``.

    Raises ``TypeError`` for a value msgpack cannot encode, ``OverflowError`` for an int
    outside ``[-2**63, 2**64)``.
    """
    return _encoder.encode(batch)


def decode_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a vLLM-format payload (ours or a real vLLM's) into a `KVEventBatch`.

    Unknown event fields are ignored. Raises ``msgspec.DecodeError`` (a ``ValueError``;
    ``msgspec.ValidationError`` when the msgpack is well formed but not the schema).
    """
    return _decoder.decode(data)


__all__ = ["decode_batch", "encode_batch"]
