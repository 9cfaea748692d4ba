"""The engine loops' clock and event loop, shared by ``kvpool simulate`` and ``kvpool serve``.

`WallPacer` paces simulated time against the wall clock: with ``speedup_ratio`` R > 0,
simulated second ``t`` is due at wall time ``start + t / R``, and `pace` sleeps until
then (it never sleeps at R = 0, a loop's full speed), keeping how late each pace
returned. `event_loop` is anyio's backend for a ``--loop`` choice (uvloop when installed
for ``auto``), what both commands run on.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import anyio


class WallPacer:
    """Simulated time run ``speedup_ratio`` times faster than the wall, from `start`.

    ``worst_lag_s`` is the latest a `pace` returned past its due time (wall seconds),
    ``lag_counts`` the paces by lateness in whole milliseconds, rounded up (0: on time).
    """

    __slots__ = ("lag_counts", "paced", "speedup_ratio", "start_s", "worst_lag_s")

    def __init__(self, speedup_ratio: float) -> None:
        self.speedup_ratio = speedup_ratio
        self.paced = speedup_ratio > 0
        """Whether simulated time is tied to the wall clock. An attribute, not a property:
        the compiled simulation reads it once a request."""
        self.start_s = time.perf_counter()
        self.worst_lag_s = 0.0
        self.lag_counts: Counter[int] = Counter()

    def start(self) -> None:
        """Make now simulated time 0."""
        self.start_s = time.perf_counter()

    def now(self, wall: float) -> float:
        """The simulated time of ``wall`` (a ``time.perf_counter()`` reading); paced only."""
        return (wall - self.start_s) * self.speedup_ratio

    async def sleep_until(self, clock: float) -> None:
        """Sleep until simulated ``clock`` is due (paced only); no lag is kept."""
        delay = self.start_s + clock / self.speedup_ratio - time.perf_counter()
        if delay > 0:
            await anyio.sleep(delay)

    async def pace(self, clock: float) -> None:
        """Sleep until simulated ``clock`` is due (paced only) and keep how late it woke."""
        deadline = self.start_s + clock / self.speedup_ratio
        delay = deadline - time.perf_counter()
        if delay > 0:
            await anyio.sleep(delay)
        lag = time.perf_counter() - deadline
        self.lag_counts[max(0, math.ceil(lag * 1000))] += 1
        if lag > self.worst_lag_s:
            self.worst_lag_s = lag


def event_loop(loop: str = "auto") -> tuple[str, dict[str, object]]:
    """anyio's backend name and options for ``loop`` (``auto``, ``uvloop``, ``asyncio``
    or ``trio``); ImportError if the one asked for is missing (``auto`` falls back to
    asyncio without uvloop)."""
    if loop == "trio":
        try:
            import trio  # noqa: F401
        except ImportError as exc:
            raise ImportError("--loop trio: trio is not installed: pip install trio") from exc
        return "trio", {}
    if loop == "asyncio":
        return "asyncio", {}
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if loop == "uvloop":
            raise ImportError("--loop uvloop: uvloop is not installed: pip install uvloop") from exc
        return "asyncio", {}
    return "asyncio", {"use_uvloop": True}
