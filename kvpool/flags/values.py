"""The argument types both commands' flags parse with, and their shared bounds: a flag
past its bound is a usage error (one line, nothing run), not a run that hangs or dies."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MAX_PORT = 65535
MAX_WORKERS = 10_000  # each holds a pool, a manager and (actor backend) a task
_MIN_SPEEDUP = 1e-6
_MAX_SPEEDUP = 1e9


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
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
