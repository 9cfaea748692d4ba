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
