"""The one rule for a caller's run of items (hashes, block ids, token ids).

A run is a `Sequence` that is not text or bytes: a list as it is, a tuple, a range or
an array copied into a list. Iterators and generators (read once, so a refused call
would have eaten them), sets and dicts (no order a caller chose) are refused. Every
layer checks a caller's items with `as_list`, so the bare pool, the actor and the
manager accept and refuse the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.errors import InvalidArgumentError


def as_list(items: object, name: str = "prefix") -> list[Any]:
    """``items`` as a list, or `InvalidArgumentError` naming ``name``."""
    if type(items) is list:
        return items
    if isinstance(items, str | bytes | bytearray | memoryview) or not isinstance(items, Sequence):
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {items!r:.200}")
    return list(items)
