"""Runs of consecutive ints: how the pool's range methods take and give chains and tables.

A *runs* list holds ints as ``first, count`` pairs, flat (``[7, 3, 20, 1]`` holds 7, 8,
9, 20): a request's chain of block hashes is a few runs (a run key's stretch, a trace
block's blocks) and its table of block ids a few more (an allocation's pages), so a call
that takes or gives them as runs costs a step per run, not per block
(`kvpool.pool.BlockPool`'s ``*_runs`` methods, the manager's block tables).

Compiled with mypyc with the pool core (setup.py).
"""

from __future__ import annotations

from typing import Final

BOXED_BITS: Final = 62
"""Ints of at most this many bits are machine words to mypyc; a larger one is boxed, and
each arithmetic or comparison on it with a constant allocates. A boxed int (a token
hash, an id never is) starts a run of its own: a run is only a shorter spelling, and
token hashes never follow each other, so merging one would cost every append and save
nothing. ``x.bit_length() > BOXED_BITS`` is the cheap way to ask."""


def add_run(runs: list[int], first: int, count: int) -> None:
    """Append ``count >= 1`` consecutive ints from ``first`` to ``runs``, continuing its
    last run when they follow it (`BOXED_BITS`: not a boxed one's)."""
    if runs and first.bit_length() <= BOXED_BITS and runs[-2] + runs[-1] == first:
        runs[-1] += count
    else:
        runs.append(first)
        runs.append(count)


def extend_runs(runs: list[int], more: list[int]) -> None:
    """Append the ints of the runs ``more`` to ``runs`` (`add_run` of each)."""
    for r in range(0, len(more), 2):
        if more[r + 1]:
            add_run(runs, more[r], more[r + 1])


def expand(runs: list[int]) -> list[int]:
    """The ints ``runs`` holds, as one list."""
    if len(runs) == 2:
        return list(range(runs[0], runs[0] + runs[1]))
    items: list[int] = []
    for r in range(0, len(runs), 2):
        items.extend(range(runs[r], runs[r] + runs[r + 1]))
    return items


def runs_of(items: list[int]) -> list[int]:
    """The runs of ``items`` (ints), in order."""
    runs: list[int] = []
    for item in items:
        add_run(runs, item, 1)
    return runs


def slice_runs(runs: list[int], start: int, stop: int, length: int = -1) -> list[int]:
    """The runs of the ints at positions ``[start, stop)`` of ``runs``. Given ``runs``'
    length, a slice in its second half is found from the end (`run_at`: the blocks a
    decode step fills are a table's last)."""
    r = 0
    position = 0  # where run ``r`` starts
    if length > 0 and 2 * start >= length:
        r = len(runs) - 2
        position = length - runs[r + 1]
        while r > 0 and position > start:
            r -= 2
            position -= runs[r + 1]
    sliced: list[int] = []
    while r < len(runs) and position < stop:
        count = runs[r + 1]
        low = start if start > position else position
        high = stop if stop < position + count else position + count
        if low < high:
            # the run's own first int when it starts the slice: a token hash (boxed) is
            # then the very object the caller holds, which a dict lookup matches by
            # identity, and no new int is made
            sliced.append(runs[r] if low == position else runs[r] + low - position)
            sliced.append(high - low)
        position += count
        r += 2
    return sliced


def add_descent(runs: list[int], top: int, count: int) -> None:
    """Append the ``count >= 1`` ints ``top, top - 1, ...`` to the *descending* runs
    ``runs`` (flat ``top, count`` pairs: an extent's copies are evicted last first),
    continuing its last run when they follow it (`BOXED_BITS`: not a boxed one's)."""
    if runs and top.bit_length() <= BOXED_BITS and runs[-2] - runs[-1] == top:
        runs[-1] += count
    else:
        runs.append(top)
        runs.append(count)


def expand_descents(runs: list[int]) -> list[int]:
    """The ints the descending runs ``runs`` hold (`add_descent`), as one list."""
    items: list[int] = []
    for r in range(0, len(runs), 2):
        if runs[r + 1] == 1:
            items.append(runs[r])  # a token hash's range would count in long arithmetic
        else:
            items.extend(range(runs[r], runs[r] - runs[r + 1], -1))
    return items


def descents_of(items: list[int]) -> list[int]:
    """The descending runs (`add_descent`) of ``items`` (ints), in order."""
    runs: list[int] = []
    for item in items:
        add_descent(runs, item, 1)
    return runs


def last_of(runs: list[int]) -> int:
    """The last int of ``runs``, or -1 when it holds none."""
    return runs[-2] + runs[-1] - 1 if runs else -1


def run_at(runs: list[int], position: int, length: int = -1) -> int:
    """The int at ``position`` of ``runs`` (which must hold it). Given ``runs``' length,
    a position in its second half is found from the end (a table's last block, one run
    a block for token hashes, costs a step, not a walk of the chain)."""
    if length > 0 and 2 * position >= length:
        back = length - position  # from the end: the last int is 1 back
        for r in range(len(runs) - 2, -1, -2):
            count = runs[r + 1]
            if back <= count:
                return runs[r] + count - back
            back -= count
        raise IndexError("position out of the runs")
    for r in range(0, len(runs), 2):
        count = runs[r + 1]
        if position < count:
            return runs[r] + position
        position -= count
    raise IndexError("position out of the runs")


def truncate_runs(runs: list[int], length: int) -> None:
    """Keep only the first ``length`` ints of ``runs`` (in place)."""
    position = 0
    for r in range(0, len(runs), 2):
        count = runs[r + 1]
        if position + count >= length:
            if length > position:
                runs[r + 1] = length - position
                del runs[r + 2 :]
            else:
                del runs[r:]
            return
        position += count


def overlapping(runs: list[int]) -> bool:
    """Whether two of the runs hold a common int."""
    if len(runs) <= 2:
        return False
    end = runs[0] + runs[1]
    for r in range(2, len(runs), 2):  # ascending runs (a table, mostly) cannot overlap
        if runs[r] < end:
            break
        end = runs[r] + runs[r + 1]
    else:
        return False
    # Runs that each lie in a 64-aligned window of their own cannot overlap: one set
    # lookup a run (a stretch's runs are each request's own blocks), sorting only when
    # two share a window or one spans windows.
    windows: set[int] = set()
    for r in range(0, len(runs), 2):
        count = runs[r + 1]
        if count:
            window = runs[r] >> 6
            if window != (runs[r] + count - 1) >> 6 or window in windows:
                return _overlapping_sorted(runs)
            windows.add(window)
    return False


def _overlapping_sorted(runs: list[int]) -> bool:
    spans = sorted((runs[r], runs[r] + runs[r + 1]) for r in range(0, len(runs), 2) if runs[r + 1])
    return any(spans[i][0] < spans[i - 1][1] for i in range(1, len(spans)))


def runs_length(runs: list[int]) -> int:
    """How many ints ``runs`` holds."""
    total = 0
    for r in range(1, len(runs), 2):
        total += runs[r]
    return total


__all__ = [
    "BOXED_BITS",
    "add_descent",
    "add_run",
    "descents_of",
    "expand",
    "expand_descents",
    "extend_runs",
    "last_of",
    "overlapping",
    "run_at",
    "runs_length",
    "runs_of",
    "slice_runs",
    "truncate_runs",
]
