"""The pool's public value types: block ids, prefix hits, reservations and their outcome."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NewType

import msgspec
from mypy_extensions import mypyc_attr

if TYPE_CHECKING:
    from kvpool.pool.block_pool import BlockPool

BlockId = NewType("BlockId", int)
"""An opaque, never-reused name of one physical copy: its slot plus a process-wide serial."""

MAX_HASH: Final = (1 << 64) - 1
"""Block hashes are u64 (``SequenceHash`` in the reference)."""


class PrefixHit(msgspec.Struct, frozen=True, gc=False):
    """A resident hash's first copy: active iff it holds a reference or a pin."""

    is_active: bool


ACTIVE_HIT: Final = PrefixHit(True)
INACTIVE_HIT: Final = PrefixHit(False)


class Admission(msgspec.Struct, frozen=True, gc=False):
    """One admitted chain: the caller now owns one reference to every block in ``blocks``.

    ``blocks`` lists the ids in chain order, then the ``extra`` ones; the first ``cached``
    are the chain's resident prefix (``active_cached`` of them were already in use), the
    rest are fresh private copies. ``removed`` lists the hashes whose last copy was evicted
    to make room, in eviction order. ``stored`` holds, for each fresh block `BlockPool.admit`
    was asked to ``cache``, whether it is its hash's first resident copy (as
    `BlockPool.cache_chain` flags them).
    """

    blocks: list[BlockId]
    cached: int
    active_cached: int
    removed: list[int]
    stored: list[bool] = []


class RunAdmission(msgspec.Struct, frozen=True, gc=False):
    """`BlockPool.admit_runs`' result: an `Admission` whose ``blocks`` are held as runs
    of consecutive ids (``ids``: flat ``first, count`` pairs, in order), whose
    ``removed`` hashes as descending runs (flat ``top, count`` pairs: ``top, top - 1,
    ...``, `kvpool.pool.runs.add_descent`) and whose ``stored`` flags as runs of the
    positions (0 the first fresh block) that are set, so that a request's first
    allocation builds no list of its blocks."""

    ids: list[int]
    cached: int
    active_cached: int
    removed: list[int]
    stored: list[int] = []


@mypyc_attr(acyclic=True)  # refers to its pool; nothing refers back
class Reservation:
    """Capacity and cached-prefix pins held before a caller commits ownership.

    Only its pool reads or changes the fields; callers use ``len()``, ``fresh``,
    ``prefix_len`` and ``closed``. The prefix holds the pinned copies' ids root first, as
    runs of consecutive ids (flat ``first, count`` pairs: pinned copies stay resident,
    so their ids stay valid); ``cancel`` unpins them leaf first and closes the
    reservation for good.
    """

    __slots__ = ("_closed", "_fresh", "_last", "_pool", "_prefix", "_prefix_len")

    def __init__(self, pool: BlockPool, prefix: list[int], prefix_len: int, fresh: int) -> None:
        self._pool = pool
        self._prefix = prefix
        self._prefix_len = prefix_len
        self._fresh = fresh
        self._closed = False
        self._last = -1  # the last private copy allocated, which the next one follows

    def __len__(self) -> int:
        return self._prefix_len + self._fresh

    @property
    def fresh(self) -> int:
        """Fresh (not prefix) blocks still reserved and not yet allocated."""
        return self._fresh

    @property
    def prefix_len(self) -> int:
        """Pinned prefix blocks not yet activated."""
        return self._prefix_len

    @property
    def closed(self) -> bool:
        """True once the reservation was cancelled."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"prefix={self._prefix_len}, fresh={self._fresh}"
        return f"Reservation({state})"


@mypyc_attr(acyclic=True)
class ReserveOutcome:
    """A successful reserve: the reservation, and hashes whose last copy was evicted."""

    __slots__ = ("removed", "reservation")

    def __init__(self, reservation: Reservation, removed: list[int]) -> None:
        self.reservation = reservation
        self.removed = removed

    def __repr__(self) -> str:
        return f"ReserveOutcome(reservation={self.reservation!r}, removed={self.removed!r})"
