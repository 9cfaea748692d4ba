"""Byte-for-byte equality with vLLM's KV-event schema, both directions, every event kind.

The ``Vllm*`` classes below restate vLLM 0.33.0's ``vllm/distributed/kv_events.py``
(``/work/shared/reference/vllm-0.33.0/kv_events.py``; it carries vllm-project/vllm#42892)
independently of kvpool, field by field in its order: batch ``array_like``, events
tagged maps, ``omit_defaults`` and ``gc=False`` as vLLM declares them, BlockStored with
0.33.0's ``locality``, ``ownership``, ``session_id`` and ``lookahead_token_ids``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvpool.events import types as event_types
from kvpool.events.codec import decode_array_batch


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
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


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


vllm_encoder = msgspec.msgpack.Encoder()
vllm_decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)

_VLLM_DEFAULTS = {
    "extra_keys": None,
    "group_idx": None,
    "kv_cache_spec_kind": None,
    "kv_cache_spec_sliding_window": None,
    "locality": None,
    "ownership": None,
    "session_id": None,
    "lookahead_token_ids": None,
}


def to_vllm(event: KVEvent) -> VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared:
    """The same event as vLLM would build it: kvpool's UNSET is vLLM's omitted None."""
    fields: dict[str, Any] = {
        name: (None if value is msgspec.UNSET else value)
        for name, value in msgspec.structs.asdict(event).items()
    }
    if isinstance(event, BlockStored):
        return VllmBlockStored(**fields)
    if isinstance(event, BlockRemoved):
        return VllmBlockRemoved(**fields)
    return VllmAllBlocksCleared()


def pair(batch: KVEventBatch) -> VllmKVEventBatch:
    return VllmKVEventBatch(
        ts=batch.ts,
        events=[to_vllm(e) for e in batch.events],
        data_parallel_rank=batch.data_parallel_rank,
    )


U64 = st.integers(0, 2**64 - 1)
maybe_str = st.none() | st.text(max_size=6)
maybe_int = st.none() | st.integers(0, 2**31 - 1)


def unset_or(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.just(msgspec.UNSET) | values


stored_st = st.builds(
    BlockStored,
    block_hashes=st.lists(U64, min_size=1, max_size=4),
    parent_block_hash=st.none() | U64,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=16),
    block_size=st.integers(1, 64),
    lora_id=maybe_int,
    medium=maybe_str,
    lora_name=maybe_str,
    extra_keys=unset_or(st.lists(st.none() | st.tuples(st.text(max_size=4)), max_size=3)),
    group_idx=unset_or(st.integers(0, 8)),
    kv_cache_spec_kind=unset_or(st.sampled_from(["full_attention", "sliding_window"])),
    kv_cache_spec_sliding_window=unset_or(st.integers(1, 4096)),
    locality=unset_or(st.sampled_from([None, "LOCAL", "REMOTE"])),
    ownership=unset_or(maybe_str),
    session_id=unset_or(maybe_str),
    lookahead_token_ids=unset_or(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=3))),
)
removed_st = st.builds(
    BlockRemoved,
    block_hashes=st.lists(U64, min_size=1, max_size=4),
    medium=maybe_str,
    group_idx=unset_or(st.integers(0, 8)),
    locality=unset_or(st.sampled_from([None, "LOCAL", "REMOTE"])),
    ownership=unset_or(maybe_str),
)
event_st: st.SearchStrategy[KVEvent] = stored_st | removed_st | st.just(AllBlocksCleared())
batch_st = st.builds(
    KVEventBatch,
    ts=st.floats(0, 2e9, allow_nan=False),
    events=st.lists(event_st, max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 64),
)

EXAMPLES = [
    pytest.param(
        KVEventBatch(
            ts=1789095808.8378847,
            events=[
                BlockStored(
                    block_hashes=[15310707395893867146, 13769157705258532664],
                    parent_block_hash=None,
                    token_ids=list(range(32)),
                    block_size=16,
                )
            ],
            data_parallel_rank=0,
        ),
        id="stored-defaults",
    ),
    pytest.param(
        KVEventBatch(
            ts=2.5,
            events=[
                BlockStored(
                    block_hashes=[7],
                    parent_block_hash=2**64 - 1,
                    token_ids=[1, 2],
                    block_size=2,
                    lora_id=3,
                    medium=None,
                    lora_name="adapter",
                    extra_keys=[None],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                    kv_cache_spec_sliding_window=128,
                    locality="LOCAL",
                    ownership="tier-2",
                    session_id="session-1",
                    lookahead_token_ids=[[3, 4]],
                )
            ],
            data_parallel_rank=3,
        ),
        id="stored-every-field",
    ),
    pytest.param(
        KVEventBatch(
            ts=2.75,
            events=[
                BlockStored(
                    block_hashes=[8],
                    parent_block_hash=7,
                    token_ids=[5, 6],
                    block_size=2,
                    session_id="s",
                ),
                BlockRemoved(block_hashes=[7], locality="REMOTE", ownership="o"),
            ],
            data_parallel_rank=0,
        ),
        id="vllm-0.33-fields",
    ),
    pytest.param(
        KVEventBatch(ts=3.0, events=[BlockRemoved(block_hashes=[1, 2, 3])], data_parallel_rank=1),
        id="removed",
    ),
    pytest.param(
        KVEventBatch(ts=4.0, events=[BlockRemoved(block_hashes=[9], medium=None, group_idx=2)]),
        id="removed-group-no-rank",
    ),
    pytest.param(KVEventBatch(ts=5.0, events=[AllBlocksCleared()]), id="cleared"),
    pytest.param(KVEventBatch(ts=6.0, events=[], data_parallel_rank=0), id="empty"),
]


@pytest.mark.parametrize("batch", EXAMPLES)
def test_every_kind_encodes_to_vllms_exact_bytes(batch: KVEventBatch) -> None:
    assert encode_batch(batch) == vllm_encoder.encode(pair(batch))


@pytest.mark.parametrize("batch", EXAMPLES)
def test_every_kind_round_trips_through_vllms_decoder(batch: KVEventBatch) -> None:
    ours = encode_batch(batch)
    theirs = vllm_decoder.decode(ours)
    assert theirs == pair(batch)
    assert vllm_encoder.encode(theirs) == ours
    assert decode_batch(vllm_encoder.encode(theirs)) == batch


@pytest.mark.slow
@given(batch=batch_st)
def test_random_batches_are_byte_identical_both_ways(batch: KVEventBatch) -> None:
    ours = encode_batch(batch)
    theirs = vllm_encoder.encode(pair(batch))
    assert ours == theirs
    assert vllm_encoder.encode(vllm_decoder.decode(ours)) == ours
    assert decode_batch(theirs) == batch


def test_wire_shape_is_positional_batch_of_type_tagged_maps() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5, 6], block_size=2),
            BlockRemoved(block_hashes=[1]),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [5, 6],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        2,
    ]
    assert [next(iter(event)) for event in raw[1]] == ["type"] * 3  # the tag comes first


def test_unknown_fields_from_a_newer_vllm_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [4],
                    "medium": "GPU",
                    "a_field_from_vllm_0_40": "LOCAL",
                }
            ],
            0,
        ]
    )
    assert decode_batch(payload) == KVEventBatch(
        ts=1.0, events=[BlockRemoved(block_hashes=[4])], data_parallel_rank=0
    )


class LegacyVllmKVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    """vLLM before #42892: the same events, positional."""


class LegacyVllmBlockStored(LegacyVllmKVCacheEvent, tag="BlockStored"):
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


class LegacyVllmBlockRemoved(LegacyVllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class LegacyVllmAllBlocksCleared(LegacyVllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyVllmKVEventBatch(VllmEventBatch):
    events: list[LegacyVllmBlockStored | LegacyVllmBlockRemoved | LegacyVllmAllBlocksCleared]


def to_legacy(batch: KVEventBatch) -> LegacyVllmKVEventBatch:
    events: list[Any] = []
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            events.append(LegacyVllmAllBlocksCleared())
            continue
        fields = {
            k: (None if v is msgspec.UNSET else v) for k, v in msgspec.structs.asdict(event).items()
        }
        kind = LegacyVllmBlockStored if isinstance(event, BlockStored) else LegacyVllmBlockRemoved
        events.append(kind(**fields))
    return LegacyVllmKVEventBatch(batch.ts, events, batch.data_parallel_rank)


@pytest.mark.parametrize("batch", EXAMPLES)
def test_array_format_matches_pre_42892_vllm_bytes(batch: KVEventBatch) -> None:
    ours = encode_batch(batch, "array")
    assert ours == vllm_encoder.encode(to_legacy(batch))
    decoded = decode_array_batch(ours)
    assert encode_batch(decoded, "array") == ours


def test_array_format_shape_is_positional_events() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5, 6], block_size=2),
            BlockRemoved(block_hashes=[1]),
        ],
    )
    stored, removed = msgspec.msgpack.decode(encode_batch(batch, "array"))[1]
    # tag first, then every field in declaration order (msgspec writes array_like
    # structs whole), as the same classes with array_like=True did in vLLM
    assert stored[:8] == ["BlockStored", [1], None, [5, 6], 2, None, "GPU", None]
    assert stored[8:] == [None] * 8
    assert removed == ["BlockRemoved", [1], "GPU", None, None, None]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # a map, not the positional batch
        msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted", "block_hashes": []}]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["h"]}]]),
    ],
    ids=["not-msgpack", "map-batch", "unknown-tag", "bad-hash-type"],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)


@pytest.mark.parametrize(
    ("kind", "name"),
    [(BlockStored, name) for name in event_types._STORED_OPTIONAL]
    + [(BlockRemoved, name) for name in event_types._REMOVED_OPTIONAL],
)
def test_an_explicit_none_in_any_optional_field_is_omitted_as_vllm_omits_it(
    kind: type[BlockStored] | type[BlockRemoved], name: str
) -> None:
    """Each optional field on its own: the event's one-test fast path must see every one."""
    base: dict[str, Any] = {"block_hashes": [1, 2]}
    if kind is BlockStored:
        base |= {"parent_block_hash": None, "token_ids": [7, 8], "block_size": 1}
    event = kind(**base, **{name: None})
    assert getattr(event, name) is msgspec.UNSET
    assert event == kind(**base)
    batch = KVEventBatch(ts=1.0, events=[event])
    assert encode_batch(batch) == vllm_encoder.encode(pair(batch))
