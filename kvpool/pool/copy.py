"""One physical copy of a block: the pool's only per-block record."""

from __future__ import annotations

import msgspec


class Copy(msgspec.Struct, eq=False, gc=False):
    """A physical copy: private (``hash is None``) or cached (findable by ``hash``).

    ``refs`` counts request references (a private copy holds exactly one); ``pins``
    counts unactivated reservations. A cached copy is linked into the inactive LRU
    (``prev``/``next`` not None) if and only if both ``refs`` and ``pins`` are zero.

    ``gc=False`` keeps the record at 64 bytes and out of the cyclic collector; the LRU
    links do form cycles, so the pool breaks them itself when it is dropped.
    """

    id: int
    hash: int | None
    refs: int
    pins: int = 0
    prev: Copy | None = None
    next: Copy | None = None
