"""The pool protocol: every message kind round-trips through msgpack, tagged by kind."""

from __future__ import annotations

import msgspec
import pytest

from kvpool import errors
from kvpool.messages import (
    ActivatePrefix,
    Admission,
    Admit,
    AdmitReply,
    AllocateCached,
    AllocatePrivate,
    BlockReply,
    BlocksReply,
    CachedBlockReply,
    CacheMany,
    CachePrivate,
    Cancel,
    CheckInvariants,
    DoneReply,
    ErrorReply,
    FlagReply,
    FlagsReply,
    Free,
    GetStats,
    Message,
    PoolStats,
    PrefixHitReply,
    QueryPrefix,
    Release,
    Reply,
    Request,
    Reserve,
    ReserveReply,
    StatsReply,
    decode,
    encode,
    error_from_reply,
    error_reply,
)
from kvpool.pool import PrefixHit

BIG = (1 << 64) - 1

SAMPLES: list[Message] = [
    QueryPrefix(BIG),
    Reserve([1, 2, BIG], 3),
    ActivatePrefix(7),
    AllocatePrivate(7),
    AllocateCached(7, 42),
    CachePrivate(1 << 40, 42),
    Release(1 << 40),
    Cancel(7),
    GetStats(),
    CheckInvariants(),
    Admit([1, 2, 3], 2, True),
    Admit([]),
    CacheMany([(1 << 40, 5), (2 << 40, BIG)]),
    Free([1 << 40, 2 << 40]),
    PrefixHitReply(PrefixHit(True)),
    PrefixHitReply(None),
    ReserveReply(3, 1, 2, [9, 8]),
    ReserveReply(None),
    BlocksReply([1 << 40]),
    BlockReply(1 << 40),
    CachedBlockReply(1 << 40, True),
    FlagReply(False),
    FlagsReply([True, False]),
    DoneReply(),
    StatsReply(PoolStats(8, 3, 2, 4, 10, 1, 5, 0)),
    AdmitReply(Admission([1, 2, 3], 1, 1, [7])),
    AdmitReply(None),
    ErrorReply("UnknownBlockError", "block 3 is gone"),
]


def _union_members(alias: object) -> set[type]:
    return set(alias.__args__)  # type: ignore[attr-defined]


def test_the_samples_cover_every_request_and_reply_kind() -> None:
    kinds = {type(sample) for sample in SAMPLES}
    assert kinds == _union_members(Request) | _union_members(Reply)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_through_msgpack(message: Message) -> None:
    data = encode(message)
    back = decode(data)
    assert type(back) is type(message)
    assert back == message


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_is_tagged_with_its_class_name(message: Message) -> None:
    raw = msgspec.msgpack.decode(encode(message))
    assert raw["type"] == type(message).__name__


def test_request_kinds_decode_as_the_right_type_even_with_equal_fields() -> None:
    # ActivatePrefix, AllocatePrivate and Cancel have the same shape; only the tag differs.
    assert type(decode(encode(Cancel(4)))) is Cancel
    assert type(decode(encode(ActivatePrefix(4)))) is ActivatePrefix


def test_a_malformed_message_is_rejected_by_the_decoder() -> None:
    bad = msgspec.msgpack.encode({"type": "Reserve", "prefix": ["x"], "fresh": 1})
    with pytest.raises(msgspec.ValidationError):
        decode(bad)
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"type": "NoSuchKind"}))


@pytest.mark.parametrize(
    "error",
    [
        errors.UnknownBlockError("block 3 is gone"),
        errors.ReservationClosedError("closed"),
        errors.CapacityError("too big"),
        errors.InvalidHashError("bad hash"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_reply_rebuilds_the_same_error_class(error: errors.PoolError) -> None:
    rebuilt = error_from_reply(decode(encode(error_reply(error))))  # type: ignore[arg-type]
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)


def test_an_unknown_error_name_becomes_a_plain_pool_error() -> None:
    rebuilt = error_from_reply(ErrorReply("Nonsense", "what"))
    assert type(rebuilt) is errors.PoolError
    assert "Nonsense" in str(rebuilt)
    rebuilt = error_from_reply(ErrorReply("ValueError", "not ours"))
    assert type(rebuilt) is errors.PoolError
