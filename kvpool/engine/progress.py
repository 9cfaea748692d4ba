"""A one-line progress bar for a terminal (stdlib only), redrawn at most ten times a second."""

from __future__ import annotations

import os
import shutil
import time
from typing import TextIO

_MIN_BAR = 10  # a narrower bar says nothing: drop it


class ProgressBar:
    """Draws ``[####....] done/total requests, simulated and wall time`` on ``stream``.

    Call it as a `ProgressCallback`; `close` draws the final state and ends the line.
    Meant for a TTY: the CLI only creates one when stderr is a terminal. Every line fits
    the terminal's width, read at each draw (a resized window is followed): the bar
    narrows, then goes, then the text is cut; it is padded to the width so a shorter
    line leaves nothing of the last one behind. ``width`` is the widest the bar gets.
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
        share = 100 * done // total if total else 0
        counts = f"{done}/{total} requests {share:3d}%" if total else f"{done} requests"
        text = f"{counts}  simulated {simulated_s:8.2f}s  wall {now - self._start:6.2f}s"
        room = self._columns() - 1  # the last column would wrap on some terminals
        bar_width = min(self._width, room - len(text) - 3)
        if total and bar_width >= _MIN_BAR:
            filled = bar_width * done // total
            text = f"[{'#' * filled}{'.' * (bar_width - filled)}] {text}"
        self._stream.write("\r" + text[:room].ljust(room))
        self._stream.flush()
        self._drawn = True

    def _columns(self) -> int:
        """The terminal's width: $COLUMNS if set, else the stream's terminal, else 80."""
        if "COLUMNS" not in os.environ:
            try:
                return os.get_terminal_size(self._stream.fileno()).columns or 80
            except (AttributeError, OSError, ValueError):
                pass
        return shutil.get_terminal_size((80, 24)).columns
