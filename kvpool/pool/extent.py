"""A run of physical copies in one state: the pool's only per-block record."""

from __future__ import annotations

from typing import Final

from mypy_extensions import mypyc_attr

PIN: Final = 1 << 32
"""``holds`` packs pins above references: ``holds = refs + pins * PIN``."""

REF_MASK: Final = PIN - 1

PRIVATE: Final = -1
"""The ``hash`` of an extent of private copies (findable by no hash)."""


@mypyc_attr(acyclic=True)
class Extent:
    """``n >= 1`` physical copies that are alike but for their ids, hashes and stamps.

    Copy ``i`` (``0 <= i < n``) has id ``id + i`` and, when cached, hash ``hash + i``; a
    private extent has ``hash == PRIVATE``. All copies hold ``holds`` (request references
    in the low 32 bits, unactivated pins above them); a private copy holds exactly one
    reference. A cached extent is linked into the pool's inactive LRU (``prev``/``next``
    not None) if and only if ``holds == 0``.

    ``stamp`` orders the LRU: copy ``i`` was last let go of at pool clock ``stamp + (n -
    1 - i)`` (the last copy first: a table is released leaf first), or, with ``stamp ==
    0``, never (every copy 0). Eviction takes the lowest stamps, so an extent loses its
    last copies first; ``BlockPool.unadmit`` puts an extent back at its stamp's place.

    An extent never spans two id pages nor, cached, two hash buckets (the pool's two
    indexes; `kvpool.pool.block_pool` says why). The pool splits an extent where an
    operation covers only part of it, and may merge neighbours that become alike again:
    neither changes anything a caller can observe.

    Compiled, an extent stays out of the cyclic garbage collector (``acyclic``); the LRU
    links are the only cycles extents form, and the pool breaks them itself.
    """

    __slots__ = ("hash", "holds", "id", "n", "next", "prev", "stamp")

    def __init__(self, id: int, n: int, hash: int, holds: int, stamp: int) -> None:
        self.id = id
        self.n = n
        self.hash = hash
        self.holds = holds
        self.stamp = stamp
        self.prev: Extent | None = None
        self.next: Extent | None = None

    @property
    def refs(self) -> int:
        """Request references each copy holds."""
        return self.holds & REF_MASK

    @property
    def pins(self) -> int:
        """Unactivated reservations pinning each copy."""
        return self.holds >> 32

    def __repr__(self) -> str:
        what = "private" if self.hash == PRIVATE else f"hash={self.hash}"
        return f"Extent(id={self.id}, n={self.n}, {what}, refs={self.refs}, pins={self.pins})"
