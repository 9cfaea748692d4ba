"""A `DecodeRun`'s slots spelled out, and a stretch's allocations gathered per request.

`kvpool.manager.types.DecodeRun` defines its slots and `RunAllocations` its result; these
are the loops behind ``DecodeRun.stretch`` and ``RunAllocations.of_stretch``, compiled
(mypyc) because `KvManager.allocate_run` takes them on every run it cannot do at once
(a probe, or events on: `kvpool serve`'s runs), where interpreted they cost as much as
the pool's work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.pool.runs import add_descent, extend_runs

RunFields = tuple[list[str], list[Sequence[int]], list[int], list[int], list[int], int]
"""A `kvpool.manager.types.DecodeRun`'s fields, in order."""


class SlotBlocks(Protocol):
    """What `gather` reads of a slot's allocation (`kvpool.manager.types.Allocation`)."""

    @property
    def block_runs(self) -> list[int]: ...

    @property
    def removed_runs(self) -> list[int]: ...


def spell_out(
    grows: list[int],
    fills: list[int],
    targets: list[int],
    sizes: list[int],
    steps: int,
    block_size: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The ``members``, ``targets``, ``appends`` and ``step_ends`` of a run's stretch
    (`DecodeRun.stretch`), from its fields (``sizes``: how many new tokens each request
    has)."""
    count = len(grows)
    keys: list[int] = []  # a slot at step s of request i is s * count + i: sorted, in order
    last: list[int] = []  # each request's last slot
    for i in range(count):
        end = -1
        for first in (grows[i], fills[i]):
            if 0 <= first < steps:
                keys.extend(range(first * count + i, steps * count, block_size * count))
                end = max(end, first + (steps - 1 - first) // block_size * block_size)
        last.append(end)
    keys.sort()
    previous = [-1] * count
    members: list[int] = []
    slot_targets: list[int] = []
    appends: list[int] = []
    step_ends: list[int] = []
    seen = -1
    step = -1
    for key in keys:
        if key == seen:  # a request's growth and fill in one step: one slot
            continue
        seen = key
        at, i = divmod(key, count)
        if at != step and members:
            step_ends.append(len(members))
        step = at
        members.append(i)
        slot_targets.append(targets[i] + at)
        before = previous[i]
        appends.append(sizes[i] - (last[i] - at) if before < 0 else at - before)
        previous[i] = at
    if members:
        step_ends.append(len(members))
    return members, slot_targets, appends, step_ends


def gather(
    count: int, members: list[int], allocations: Sequence[SlotBlocks]
) -> tuple[list[list[int]], list[int]]:
    """Per request (``count`` of them), the block runs its slots' ``allocations``
    appended, joined; and every slot's removed hashes, as one list of descending runs."""
    joined: list[list[int]] = [[] for _ in range(count)]
    removed: list[int] = []
    for k in range(len(allocations)):
        allocation = allocations[k]
        extend_runs(joined[members[k]], allocation.block_runs)
        removed_runs = allocation.removed_runs
        for r in range(0, len(removed_runs), 2):
            add_descent(removed, removed_runs[r], removed_runs[r + 1])
    return joined, removed


def first_at(start: int, low: int, high: int, block_size: int) -> int:
    """The first step in ``[low, high]`` of the progression ``start``, ``start +
    block_size``, ... (-1: none, or ``start`` is -1)."""
    if start < 0 or start > high:
        return -1
    if start < low:
        start += -(-(low - start) // block_size) * block_size
    return start if start <= high else -1


def last_in(first: int, low: int, high: int, block_size: int) -> int:
    """The last step in ``[low, high]`` of the progression ``first``, ``first +
    block_size``, ... (-1: none, or ``first`` is -1)."""
    if first < 0 or high < first or high < low:
        return -1
    last = first + (high - first) // block_size * block_size
    return last if last >= low else -1


def slots_in(grow: int, fill: int, high: int, block_size: int) -> int:
    """A request's slots up to step ``high``: its growths' and fills' progressions, a
    step in both counted once."""
    total = 0
    for first in (grow, fill):
        if 0 <= first <= high:
            total += (high - first) // block_size + 1
    if 0 <= grow <= high and 0 <= fill <= high and grow % block_size == fill % block_size:
        total -= (high - max(grow, fill)) // block_size + 1
    return total


def split_chain(
    request_ids: list[str],
    new_tokens: list[Sequence[int]],
    targets: list[int],
    grows: list[int],
    fills: list[int],
    steps: int,
    leaves: list[int],
    frees: list[list[str]],
    block_size: int,
) -> list[tuple[RunFields | None, list[str]]]:
    """The segments of a checked `DecodeChain` from its fields (`DecodeChain.segments`):
    each one's run as a `DecodeRun`'s fields (None: no request has a slot in it) and
    its frees."""
    count = len(request_ids)
    place = {request_ids[i]: i for i in range(count)}
    cut = [steps - 1] * count  # each request's last step: its leave's, or the chain's
    for j in range(len(leaves)):
        for request_id in frees[j]:
            i = place.get(request_id, -1)
            if i >= 0:
                cut[i] = leaves[j]
    last: list[int] = []  # each request's last slot in the chain
    for i in range(count):
        end = -1
        for start in (grows[i], fills[i]):
            end = max(end, last_in(start, 0, cut[i], block_size))
        last.append(end)
    bounds = [(leaves[j - 1] + 1 if j else 0, leaves[j], frees[j]) for j in range(len(leaves))]
    if not leaves or leaves[-1] < steps - 1:
        bounds.append((leaves[-1] + 1 if leaves else 0, steps - 1, []))
    heard = [0] * count  # each request's new tokens handed to its segments so far
    segments: list[tuple[RunFields | None, list[str]]] = []
    for low, high, freed in bounds:
        ids: list[str] = []
        tokens: list[Sequence[int]] = []
        starts: list[int] = []
        firsts_grow: list[int] = []
        firsts_fill: list[int] = []
        for i in range(count):
            top = min(high, cut[i])
            grow = first_at(grows[i], low, top, block_size)
            fill = first_at(fills[i], low, top, block_size)
            if grow < 0 and fill < 0:
                continue
            end = max(last_in(grow, low, top, block_size), last_in(fill, low, top, block_size))
            upto = len(new_tokens[i]) - (last[i] - end)  # heard through its last slot here
            ids.append(request_ids[i])
            tokens.append(new_tokens[i][heard[i] : upto])
            heard[i] = upto
            starts.append(targets[i] + low)
            firsts_grow.append(grow - low if grow >= 0 else -1)
            firsts_fill.append(fill - low if fill >= 0 else -1)
        piece = (ids, tokens, starts, firsts_grow, firsts_fill, high - low + 1) if ids else None
        segments.append((piece, freed))
    return segments
