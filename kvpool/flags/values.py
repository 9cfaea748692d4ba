"""The argument types both commands' flags parse with, and their shared bounds: a flag
past its bound is a usage error (one line, nothing run), not a run that hangs or dies."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_PORT = 65535
MAX_WORKERS = 10_000  # each holds a pool, a manager and (actor backend) a task
_MIN_SPEEDUP = 1e-6
_MAX_SPEEDUP = 1e9


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer ``>= minimum`` (and ``<= maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def number_at_most(maximum: float) -> Callable[[str], float]:
    """A finite number in ``[0, maximum]``: past the bound a step or a pace is absurd,
    and the simulated clock would stop resolving it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def speedup(text: str) -> float:
    value = number_at_most(_MAX_SPEEDUP)(text)
    if 0 < value < _MIN_SPEEDUP:
        raise argparse.ArgumentTypeError(f"must be 0 or >= {_MIN_SPEEDUP:g}, got {text}")
    return value


speedup.__name__ = "number"


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "int"
    return parse


def number_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        too_low = value <= low if low_open else value < low
        if math.isnan(value) or too_low or value > high:
            bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse
