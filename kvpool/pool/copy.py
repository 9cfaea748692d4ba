"""One physical copy of a block: the pool's only per-block record."""

from __future__ import annotations

import msgspec

PIN = 1 << 32
"""``holds`` packs a copy's pins above its references: ``holds = refs + pins * PIN``."""

REF_MASK = PIN - 1


class Copy(msgspec.Struct, eq=False, gc=False):
    """A physical copy: private (``hash is None``) or cached (findable by ``hash``).

    ``holds`` counts request references in its low 32 bits and unactivated reservation
    pins above them; a private copy holds exactly one reference. A cached copy is linked
    into the inactive LRU (``prev``/``next`` not None) if and only if ``holds == 0``,
    that is, both its refs and its pins are zero: one word keeps that test one compare.

    ``gc=False`` keeps the record at 56 bytes and out of the cyclic collector; the LRU
    links do form cycles, so the pool breaks them itself when it is dropped.
    """

    id: int
    hash: int | None
    holds: int
    prev: Copy | None = None
    next: Copy | None = None

    @property
    def refs(self) -> int:
        """Request references held on this copy."""
        return self.holds & REF_MASK

    @property
    def pins(self) -> int:
        """Unactivated reservations pinning this copy."""
        return self.holds >> 32
