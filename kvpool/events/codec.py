"""msgpack encoding of `KVEventBatch`: vLLM's payload bytes, one encoder/decoder reused.

Two wire formats, chosen by the publisher (``EventFormat``):

- ``"map"`` (the default): vLLM 0.33.0's, where each event is a msgpack map tagged
  ``"type"`` (the format since vllm-project/vllm#42892). Byte-identical to vLLM's classes.
- ``"array"``: the format vLLM sent before #42892, each event a positional array
  ``[tag, field, field, ...]`` (every field, None where unset: msgspec writes an
  ``array_like`` struct whole), for
  routers that only decode that (kthena, llm-d-kv-cache before v0.9.0, Dynamo's Python
  guard before ai-dynamo/dynamo#10660). The batch is a positional array in both.

`decode_batch` reads the map format (ours or a real vLLM's); array payloads are for
consumers, and `decode_array_batch` exists to test them.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from kvpool.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

EventFormat: TypeAlias = Literal["map", "array"]
"""``"map"``: vLLM 0.33.0's events (tagged maps); ``"array"``: pre-#42892 tagged arrays."""

EVENT_FORMATS: tuple[EventFormat, ...] = ("map", "array")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the legacy positional events: ``[tag, fields...]``."""


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ArrayKVEvent: TypeAlias = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayKVEvent]
    data_parallel_rank: int | None = None


_array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)


def _fields(event: BlockStored | BlockRemoved) -> dict[str, Any]:
    # kvpool's UNSET is the legacy classes' omitted None
    return {
        name: None if value is msgspec.UNSET else value
        for name, value in msgspec.structs.asdict(event).items()
    }


def _to_array(event: BlockStored | BlockRemoved | AllBlocksCleared) -> _ArrayKVEvent:
    if isinstance(event, BlockStored):
        return _ArrayBlockStored(**_fields(event))
    if isinstance(event, BlockRemoved):
        return _ArrayBlockRemoved(**_fields(event))
    return _ArrayAllBlocksCleared()


def encode_batch(batch: KVEventBatch, event_format: EventFormat = "map") -> bytes:
    """Return ``batch`` as msgpack bytes, byte-identical to vLLM's ``KVEventBatch``.

    ``event_format`` picks vLLM 0.33.0's map-encoded events (default) or the legacy
    positional ones (see the module doc). Raises ``TypeError`` for a value msgpack
    cannot encode, ``OverflowError`` for an int outside ``[-2**63, 2**64)``,
    ``ValueError`` for an unknown format.
    """
    if event_format == "map":
        return _encoder.encode(batch)
    if event_format == "array":
        return _encoder.encode(
            _ArrayBatch(batch.ts, [_to_array(e) for e in batch.events], batch.data_parallel_rank)
        )
    raise ValueError(f"unknown event format {event_format!r}; expected one of {EVENT_FORMATS}")


def decode_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a vLLM-format payload (ours or a real vLLM's) into a `KVEventBatch`.

    Unknown event fields are ignored. Raises ``msgspec.DecodeError`` (a ``ValueError``;
    ``msgspec.ValidationError`` when the msgpack is well formed but not the schema).
    """
    return _decoder.decode(data)


def decode_array_batch(data: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a legacy (``"array"``) payload into a `KVEventBatch`; raises as
    `decode_batch` does. Optional fields absent on the wire come back as None."""
    legacy = _array_decoder.decode(data)
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in legacy.events:
        if isinstance(event, _ArrayBlockStored):
            events.append(BlockStored(**msgspec.structs.asdict(event)))
        elif isinstance(event, _ArrayBlockRemoved):
            events.append(BlockRemoved(**msgspec.structs.asdict(event)))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(legacy.ts, events, legacy.data_parallel_rank)


__all__ = [
    "EVENT_FORMATS",
    "EventFormat",
    "decode_array_batch",
    "decode_batch",
    "encode_batch",
]
