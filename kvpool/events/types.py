"""Router-visible KV events as msgspec Structs that encode exactly like vLLM's.

Schema source: vLLM 0.33.0's ``vllm/distributed/kv_events.py`` (restated field by field
in ``tests/events/test_events_wire.py``), which carries vllm-project/vllm#42892 (merged
2026-06-09): ``EventBatch`` is ``array_like`` (a positional
msgpack array ``[ts, events, data_parallel_rank]``) while ``KVCacheEvent`` is *not*: each
event is a msgpack map whose first key is ``"type"`` (msgspec ``tag=True``: the class
name), then the fields in declaration order. Both use ``omit_defaults=True, gc=False``.
Older vLLM encoded events as tagged arrays too; routers (Dynamo's vLLM wire decoder,
llm-d-kv-cache#661) accept both, and a capture from vLLM v0.26 (volcano-sh/kthena#1535)
shows exactly ``[ts, [{"type": "BlockStored", ...}], 0]``. Block hashes are ints here
(vLLM's ``ExternalBlockHash`` may also be bytes; kvpool never emits those).

vLLM declares ``lora_id``, ``medium`` and ``lora_name`` without defaults, so they are
always on the wire, and its newer optional fields (``extra_keys``, ``group_idx``,
``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, and since 0.33.0 ``locality``,
``ownership``, ``session_id`` and ``lookahead_token_ids`` on BlockStored, ``locality``
and ``ownership`` on BlockRemoved) default to None and are omitted
while None. kvpool gives the first three keyword defaults for convenience, so to stay
byte-identical our events switch ``omit_defaults`` off (every field is written) and give
the newer fields the default ``UNSET``, which msgspec never writes; an explicit None in
one of them becomes UNSET when the event is built (vLLM omits a None there). The result: same keys,
same order, same bytes as vLLM for every event, and vLLM's decoder reads ours unchanged.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

MEDIUM_GPU = "GPU"
"""vLLM's ``medium`` for blocks in GPU memory (the only tier the pool models)."""


_STORED_OPTIONAL = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_OPTIONAL = ("group_idx", "locality", "ownership")


def _omit_none(event: msgspec.Struct, names: tuple[str, ...]) -> None:
    """vLLM omits an optional field that is None (``omit_defaults``, default None): make
    an explicit None UNSET, so it is omitted here too and the bytes stay identical."""
    for name in names:
        if getattr(event, name) is None:
            msgspec.structs.force_setattr(event, name, UNSET)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, frozen=True):
    """Base of every KV event: a msgpack map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent, omit_defaults=False, frozen=True):
    """Blocks became findable by hash: the first resident cached copy of each hash.

    ``block_hashes`` are consecutive blocks of one sequence; ``parent_block_hash`` is the
    hash of the block before the first one (None at the start of a sequence);
    ``token_ids`` are all their tokens flattened (``block_size`` per block), which a
    router re-hashes to index the blocks.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | UnsetType | None = UNSET
    group_idx: int | UnsetType | None = UNSET
    kv_cache_spec_kind: str | UnsetType | None = UNSET
    kv_cache_spec_sliding_window: int | UnsetType | None = UNSET
    locality: str | UnsetType | None = UNSET
    ownership: str | UnsetType | None = UNSET
    session_id: str | UnsetType | None = UNSET
    lookahead_token_ids: list[list[int]] | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if (  # the common case, all UNSET, in one test (events are built per step)
            self.extra_keys is None
            or self.group_idx is None
            or self.kv_cache_spec_kind is None
            or self.kv_cache_spec_sliding_window is None
            or self.locality is None
            or self.ownership is None
            or self.session_id is None
            or self.lookahead_token_ids is None
        ):
            _omit_none(self, _STORED_OPTIONAL)


class BlockRemoved(KVCacheEvent, omit_defaults=False, frozen=True):
    """Hashes whose last resident copy was evicted: no longer findable."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | UnsetType | None = UNSET
    locality: str | UnsetType | None = UNSET
    ownership: str | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.group_idx is None or self.locality is None or self.ownership is None:
            _omit_none(self, _REMOVED_OPTIONAL)


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """Every cached block was dropped at once (a cache reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
"""Any one KV event."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """One publish's events, in order: ``[ts, events, data_parallel_rank]`` on the wire.

    ``ts`` is a wall-clock timestamp (seconds since the epoch); ``data_parallel_rank``
    names the engine rank whose pool produced the events (publishers fill it in when None).
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
]
