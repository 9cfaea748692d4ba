"""Argument checks shared by the manager's calls: each raises before anything changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from kvpool.errors import InvalidArgumentError

MAX_TOKEN_ID = (1 << 32) - 1
"""Token ids are hashed as little-endian u32, so they must fit in one."""


def check_request_id(request_id: object) -> str:
    """Return ``request_id`` if it is a ``str``; raise `InvalidArgumentError` otherwise."""
    if type(request_id) is not str:
        raise InvalidArgumentError(f"request id must be a str, got {request_id!r}")
    return request_id


def check_tokens(token_ids: Sequence[int]) -> list[int]:
    """Copy ``token_ids`` into a list, raising `InvalidArgumentError` unless each is a u32."""
    if isinstance(token_ids, str | bytes | bytearray) or not isinstance(token_ids, Sequence):
        _bad_tokens(token_ids)
    tokens = list(token_ids)
    if tokens and (
        not all(type(t) is int for t in tokens) or min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID
    ):
        _bad_tokens(tokens)
    return tokens


def check_count(value: object, name: str) -> int:
    """Return ``value`` if it is an ``int >= 0``; raise `InvalidArgumentError` otherwise."""
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _bad_tokens(token_ids: object) -> NoReturn:
    raise InvalidArgumentError(
        f"token ids must be a sequence of ints in [0, 2**32), got {token_ids!r:.200}"
    )
