"""A one-line progress bar for a terminal (stdlib only), redrawn at most ten times a second."""

from __future__ import annotations

import time
from typing import TextIO


class ProgressBar:
    """Draws ``[####....] done/total requests, simulated and wall time`` on ``stream``.

    Call it as a `ProgressCallback`; `close` draws the final state and ends the line.
    Meant for a TTY: the CLI only creates one when stderr is a terminal.
    """

    def __init__(self, stream: TextIO, *, width: int = 30, interval_s: float = 0.1) -> None:
        self._stream = stream
        self._width = width
        self._interval = interval_s
        self._start = time.perf_counter()
        self._last_draw = -interval_s
        self._state = (0, 0, 0.0)
        self._drawn = False

    def __call__(self, done: int, total: int, simulated_s: float) -> None:
        self._state = (done, total, simulated_s)
        now = time.perf_counter()
        if now - self._last_draw >= self._interval:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        """Draw the last state and move to a new line (only if anything was drawn)."""
        if self._drawn or self._state[1]:
            self._draw(time.perf_counter())
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        done, total, simulated_s = self._state
        filled = self._width * done // total if total else 0
        bar = "#" * filled + "." * (self._width - filled)
        share = 100 * done // total if total else 0
        self._stream.write(
            f"\r[{bar}] {done}/{total} requests {share:3d}%  "
            f"simulated {simulated_s:8.2f}s  wall {now - self._start:6.2f}s"
        )
        self._stream.flush()
        self._drawn = True
