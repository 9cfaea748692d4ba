"""All-or-nothing checks for the batched calls (``free``, ``cache_many``) before they act.

`BlockPool` validates one id per call and has no read-only query for an id, so a batch
that fails half way would have changed the pool. These checks read the pool's slot table
(a ``BlockId`` is ``serial << 32 | slot``; a slot holds a copy with ``id``, ``hash`` and
``refs``), in bulk with C-level operations on the fast path, and walk the batch one id at
a time only when that fails (to name the first offender, or to count duplicates). They
are the one place that knows those internals: tests/test_actor_bad_input.py pins them.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any, TypeGuard

from kvpool.errors import (
    AlreadyCachedError,
    BlockNotReferencedError,
    InvalidArgumentError,
    InvalidHashError,
    UnknownBlockError,
)
from kvpool.pool import MAX_HASH, BlockPool

_SLOT_MASK = (1 << 32) - 1
_ids = attrgetter("id")
_hashes = attrgetter("hash")
_refs = attrgetter("refs")


def is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    """A sequence of items, not a string: lists and tuples answer without the ABC check."""
    kind = type(value)
    if kind is list or kind is tuple:
        return True
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def check_releasable(pool: BlockPool, block_ids: object) -> None:
    """Raise unless releasing every id of ``block_ids`` (duplicates count) would succeed."""
    if not is_sequence(block_ids):
        raise InvalidArgumentError(f"block_ids must be a sequence of ints, got {block_ids!r}")
    copies = _fast_copies(pool, block_ids)
    if copies is not None and len(set(block_ids)) == len(block_ids) and 0 not in map(_refs, copies):
        return
    wanted: dict[int, int] = {}
    for block_id in block_ids:
        copy = _live_copy(pool, block_id)
        count = wanted.get(block_id, 0) + 1
        wanted[block_id] = count
        if count > copy.refs:
            raise BlockNotReferencedError(
                f"block {block_id} is released {count} time(s) but holds {copy.refs} "
                "request reference(s)"
            )


def split_cacheable(pool: BlockPool, pairs: object) -> tuple[list[Any], list[Any]]:
    """The ids and hashes of ``pairs``; raise unless caching each pair in order succeeds."""
    batch: Any = pairs
    try:
        if not is_sequence(batch):
            raise TypeError
        block_ids: list[Any] = []
        hashes: list[Any] = []
        if batch:
            # strict: every pair has the same length; two names: that length is 2.
            block_ids, hashes = map(list, zip(*batch, strict=True))
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"pairs must be a sequence of (block_id, hash) pairs, got {pairs!r}"
        ) from None
    if not block_ids:
        return block_ids, hashes
    copies = _fast_copies(pool, block_ids)
    if (
        copies is not None
        and len(set(block_ids)) == len(block_ids)
        and list(map(_hashes, copies)).count(None) == len(copies)
        and set(map(type, hashes)) == {int}
        and min(hashes) >= 0
        and max(hashes) <= MAX_HASH
    ):
        return block_ids, hashes
    seen: set[int] = set()
    for block_id, block_hash in zip(block_ids, hashes, strict=True):
        copy = _live_copy(pool, block_id)
        if copy.hash is not None or block_id in seen:
            raise AlreadyCachedError(
                f"block {block_id} is already cached; only a private copy can enter "
                "the prefix cache (each block once)"
            )
        seen.add(block_id)
        if type(block_hash) is not int or not 0 <= block_hash <= MAX_HASH:
            raise InvalidHashError(f"block hash must be an int in [0, 2**64), got {block_hash!r}")
    return block_ids, hashes


def _fast_copies(pool: BlockPool, block_ids: Sequence[Any]) -> list[Any] | None:
    """The live copies named by ``block_ids``, or None if any id is not a live int id."""
    slots: list[Any] = pool._slots  # type: ignore[attr-defined]
    try:
        if set(map(type, block_ids)) - {int}:
            return None
        copies = [slots[block_id & _SLOT_MASK] for block_id in block_ids]
        if list(map(_ids, copies)) != (block_ids if type(block_ids) is list else list(block_ids)):
            return None
    except (AttributeError, IndexError, TypeError):  # an empty slot, or out of range
        return None
    return copies


def _live_copy(pool: BlockPool, block_id: object) -> Any:
    copy = None
    if type(block_id) is int and block_id >= 0:
        slots: list[Any] = pool._slots  # type: ignore[attr-defined]
        slot = block_id & _SLOT_MASK
        if slot < len(slots):
            copy = slots[slot]
    if copy is None or copy.id != block_id:
        raise UnknownBlockError(
            f"block id {block_id!r} names no live copy of this pool "
            "(released, evicted, never allocated, or from another pool)"
        )
    return copy
