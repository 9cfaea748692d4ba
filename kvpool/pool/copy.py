"""One physical copy of a block: the pool's only per-block record."""

from __future__ import annotations

from typing import Final

from mypy_extensions import mypyc_attr

PIN: Final = 1 << 32
"""``holds`` packs a copy's pins above its references: ``holds = refs + pins * PIN``."""

REF_MASK: Final = PIN - 1


@mypyc_attr(acyclic=True)
class Copy:
    """A physical copy: private (``hash is None``) or cached (findable by ``hash``, an int).

    ``holds`` counts request references in its low 32 bits and unactivated reservation
    pins above them; a private copy holds exactly one reference. A cached copy is linked
    into the inactive LRU (``prev``/``next`` not None) if and only if ``holds == 0``,
    that is, both its refs and its pins are zero: one word keeps that test one compare.
    ``stamp`` orders the LRU (see `BlockPool.unreserve`).

    Compiled, a copy stays out of the cyclic garbage collector (``acyclic``): a pool
    allocates one per block, and collections were a quarter of the cost at a million
    blocks. The LRU links are the only cycles copies form, so the pool breaks them
    itself: on eviction, and for the whole LRU when the pool is dropped.
    """

    __slots__ = ("hash", "holds", "id", "next", "prev", "stamp")

    def __init__(self, id: int, hash: object, holds: int) -> None:
        self.id = id
        self.hash = hash
        self.holds = holds
        self.prev: Copy | None = None
        self.next: Copy | None = None
        # The pool's LRU clock when a request last let go of this cached copy (a release
        # or a cancel's unpin): the LRU is in stamp order, oldest first, so an undo can
        # put a copy back exactly where it would be had the undone call never happened.
        self.stamp = 0

    @property
    def refs(self) -> int:
        """Request references held on this copy."""
        return self.holds & REF_MASK

    @property
    def pins(self) -> int:
        """Unactivated reservations pinning this copy."""
        return self.holds >> 32

    def __repr__(self) -> str:
        return f"Copy(id={self.id}, hash={self.hash}, refs={self.refs}, pins={self.pins})"
