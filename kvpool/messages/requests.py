"""Request messages, one per pool operation, tagged with their class name.

Reservations are named by the integer handle id the actor issued in its `ReserveReply`;
blocks by their ``BlockId``. Requests are frozen: a posted request is never changed.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec


class QueryPrefix(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.prefix_hit``: is ``block_hash`` resident, and is its first copy in use."""

    block_hash: int


class Reserve(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.reserve``: pin the resident ``prefix`` and reserve ``fresh`` blocks."""

    prefix: list[int]
    fresh: int


class ActivatePrefix(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.activate_prefix`` of reservation handle ``reservation``."""

    reservation: int


class AllocatePrivate(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.allocate_private`` from reservation handle ``reservation``."""

    reservation: int


class AllocateCached(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.allocate_cached`` from reservation handle ``reservation``."""

    reservation: int
    block_hash: int


class CachePrivate(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.cache_private``: make private block ``block_id`` findable by hash."""

    block_id: int
    block_hash: int


class Release(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.release``: drop one request reference to ``block_id``."""

    block_id: int


class Cancel(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.cancel`` of reservation handle ``reservation``."""

    reservation: int


class GetStats(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A `PoolStats` snapshot."""


class CheckInvariants(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``BlockPool.check_invariants``; a breach crashes the actor."""


class Admit(msgspec.Struct, frozen=True, gc=False, tag=True):
    """In one turn: reuse ``chain``'s resident prefix, allocate the rest plus ``extra``.

    With ``wait`` the request joins the FIFO of waiters when it does not fit yet.
    """

    chain: list[int]
    extra: int = 0
    wait: bool = False


class CacheMany(msgspec.Struct, frozen=True, gc=False, tag=True):
    """``cache_private`` for every ``(block_id, block_hash)`` pair, all or nothing."""

    pairs: list[tuple[int, int]]


class Free(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Release every block of ``block_ids``, last block first (leaf first)."""

    block_ids: list[int]


Request: TypeAlias = (
    QueryPrefix
    | Reserve
    | ActivatePrefix
    | AllocatePrivate
    | AllocateCached
    | CachePrivate
    | Release
    | Cancel
    | GetStats
    | CheckInvariants
    | Admit
    | CacheMany
    | Free
)
"""Every request the pool actor understands."""
