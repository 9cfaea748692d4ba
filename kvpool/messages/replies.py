"""Reply messages, one per result shape, tagged with their class name."""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvpool.messages.values import Admission, PoolStats
from kvpool.pool import PrefixHit


class PrefixHitReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `QueryPrefix`: None when the hash is not resident."""

    hit: PrefixHit | None


class ReserveReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `Reserve`: ``reservation`` is None when it did not fit.

    Otherwise ``reservation`` is the handle id naming the reservation in later requests,
    holding ``prefix_len`` pinned prefix blocks and ``fresh`` reserved ones.
    """

    reservation: int | None
    prefix_len: int = 0
    fresh: int = 0
    removed: list[int] = msgspec.field(default_factory=list)


class BlocksReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Block ids handed to the caller, root first (`ActivatePrefix`)."""

    block_ids: list[int]


class BlockReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """One block id handed to the caller (`AllocatePrivate`)."""

    block_id: int


class CachedBlockReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """`AllocateCached`: the new copy, and whether its hash became visible (0 -> 1)."""

    block_id: int
    visible: bool


class FlagReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """`CachePrivate`: whether the hash became visible (0 -> 1)."""

    visible: bool


class FlagsReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """`CacheMany`: one visibility flag per pair, in order."""

    visible: list[bool]


class DoneReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A request with no result succeeded (`Release`, `Cancel`, `Free`, `CheckInvariants`)."""


class StatsReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `GetStats`."""

    stats: PoolStats


class AdmitReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """The answer to `Admit`: None when it did not fit (and the caller would not wait)."""

    admission: Admission | None


class ErrorReply(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A refused request, for the wire: the `kvpool.errors` class name and its message.

    In process the actor raises the exception object itself to its caller; this form
    exists so a remote peer gets the same error class back (`error_from_reply`).
    """

    error: str
    message: str


Reply: TypeAlias = (
    PrefixHitReply
    | ReserveReply
    | BlocksReply
    | BlockReply
    | CachedBlockReply
    | FlagReply
    | FlagsReply
    | DoneReply
    | StatsReply
    | AdmitReply
    | ErrorReply
)
"""Every reply the pool actor sends."""
