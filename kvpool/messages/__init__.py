"""The pool actor's protocol: one tagged msgspec Struct per request and per reply kind.

Everything here is data and wire-ready: reservations travel as integer handle ids and
blocks as their integer ``BlockId``, so every message round-trips through
``msgspec.msgpack`` (`encode` / `decode`). The in-process reply slot never appears in a
message; the actor keeps it beside the message in its mailbox.
"""

from kvpool.messages.codec import Message, decode, encode, error_from_reply, error_reply
from kvpool.messages.replies import (
    AdmitReply,
    BlockReply,
    BlocksReply,
    CachedBlockReply,
    DoneReply,
    ErrorReply,
    FlagReply,
    FlagsReply,
    PrefixHitReply,
    Reply,
    ReserveReply,
    StatsReply,
)
from kvpool.messages.requests import (
    ActivatePrefix,
    Admit,
    AllocateCached,
    AllocatePrivate,
    CacheMany,
    CachePrivate,
    Cancel,
    CheckInvariants,
    Free,
    GetStats,
    QueryPrefix,
    Release,
    Request,
    Reserve,
)
from kvpool.messages.values import Admission, PoolStats, PoolUsage

__all__ = [
    "ActivatePrefix",
    "Admission",
    "Admit",
    "AdmitReply",
    "AllocateCached",
    "AllocatePrivate",
    "BlockReply",
    "BlocksReply",
    "CacheMany",
    "CachePrivate",
    "CachedBlockReply",
    "Cancel",
    "CheckInvariants",
    "DoneReply",
    "ErrorReply",
    "FlagReply",
    "FlagsReply",
    "Free",
    "GetStats",
    "Message",
    "PoolStats",
    "PoolUsage",
    "PrefixHitReply",
    "QueryPrefix",
    "Release",
    "Reply",
    "Request",
    "Reserve",
    "ReserveReply",
    "StatsReply",
    "decode",
    "encode",
    "error_from_reply",
    "error_reply",
]
