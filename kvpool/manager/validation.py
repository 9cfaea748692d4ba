"""Argument checks shared by the manager's calls: each raises before anything changes."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import NoReturn

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.block_hash import TOKEN_TYPECODE
from kvpool.hashing.runs import TokenRuns
from kvpool.pool.items import as_list


def check_request_id(request_id: object) -> str:
    """Return ``request_id`` if it is a ``str``; raise `InvalidArgumentError` otherwise."""
    if type(request_id) is not str:
        raise InvalidArgumentError(f"request id must be a str, got {request_id!r}")
    return request_id


_TOKEN_LIMIT = 1 << 32


def check_tokens(token_ids: Sequence[int]) -> array[int] | TokenRuns | range:
    """Copy ``token_ids`` into a ``u32`` array, raising `InvalidArgumentError` unless each
    is an int in ``[0, 2**32)``; any run of them is accepted as the pool accepts hashes
    (`kvpool.pool.items`). The C-level conversion checks every token at once; a ``u32``
    array needs no check and is copied whole. `TokenRuns` (immutable, checked when
    made) is returned as it is, and a step-1 ``range`` of u32 ids as one run: the
    manager builds their tokens only if it keeps them."""
    if type(token_ids) is TokenRuns:
        return token_ids
    if (  # a run of u32 ids (a decode step's tokens): kept as it is
        type(token_ids) is range
        and token_ids.step == 1
        and token_ids.start >= 0
        and token_ids.stop <= _TOKEN_LIMIT
    ):
        return token_ids
    if type(token_ids) is array and token_ids.typecode == TOKEN_TYPECODE:
        return array(TOKEN_TYPECODE, token_ids)
    try:
        return array(TOKEN_TYPECODE, as_list(token_ids, "token ids"))
    except (OverflowError, TypeError, InvalidArgumentError):
        _bad_tokens(token_ids)


def check_count(value: object, name: str) -> int:
    """Return ``value`` if it is an ``int >= 0``; raise `InvalidArgumentError` otherwise."""
    if type(value) is not int or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_timestamp(value: object) -> float:
    """Return ``value`` as a float if it is a finite ``float`` or ``int`` (not a bool);
    raise `InvalidArgumentError` otherwise. A batch stamped NaN or inf breaks consumers
    that order batches by time."""
    if type(value) is not float and type(value) is not int:
        raise InvalidArgumentError(f"ts must be a finite float, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"ts must be a finite float, got {value!r}")
    return float(value)


def count_tokens(tokens: array[int] | TokenRuns | range) -> int:
    """How many tokens `check_tokens` returned: a `TokenRuns`' count is read, not asked
    of its ``__len__``, a call of interpreted code from this compiled module's callers."""
    return tokens.num_tokens if type(tokens) is TokenRuns else len(tokens)


def _bad_tokens(token_ids: object) -> NoReturn:
    raise InvalidArgumentError(
        f"token ids must be a sequence of ints in [0, 2**32), got {token_ids!r:.200}"
    )


__all__ = [
    "TOKEN_TYPECODE",
    "check_count",
    "check_request_id",
    "check_timestamp",
    "check_tokens",
    "count_tokens",
]
