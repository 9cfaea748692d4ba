"""A `DecodeRun` spelled out slot by slot, and a stretch's result gathered per request.

`kvpool.manager.types.DecodeRun` defines its slots; these are the two conversions
between a run and the `DecodeStretch` it stands for, compiled (mypyc) because
`KvManager.allocate_run` takes them on every run it cannot do at once (a probe, or
events on: `kvpool serve`'s runs), where the interpreted loops cost as much as the
pool's work.
"""

from __future__ import annotations

from kvpool.manager.types import (
    Allocation,
    DecodeRun,
    DecodeStretch,
    RunAllocations,
    StretchAllocations,
)
from kvpool.pool.runs import add_descent, extend_runs


def run_stretch(run: DecodeRun, block_size: int) -> DecodeStretch:
    """`DecodeRun.stretch`: the run's slots, step by step, in request order within a
    step."""
    count = len(run.request_ids)
    steps = run.steps
    grows = run.grows
    fills = run.fills
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
    run_targets = run.targets
    new_tokens = run.new_tokens
    members: list[int] = []
    targets: list[int] = []
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
        targets.append(run_targets[i] + at)
        before = previous[i]
        appends.append(len(new_tokens[i]) - (last[i] - at) if before < 0 else at - before)
        previous[i] = at
    if members:
        step_ends.append(len(members))
    return DecodeStretch(
        list(run.request_ids), list(new_tokens), members, targets, appends, step_ends
    )


def run_result(stretch: DecodeStretch, result: StretchAllocations) -> RunAllocations:
    """`RunAllocations.of_stretch`: ``result`` of the ``stretch`` a run stands for, each
    request's allocations joined into one, the removed hashes into one list."""
    joined: list[list[int]] = [[] for _ in stretch.request_ids]
    removed: list[int] = []
    members = stretch.members
    allocations = result.allocations
    for k in range(len(allocations)):
        allocation = allocations[k]
        extend_runs(joined[members[k]], allocation.block_runs)
        removed_runs = allocation.removed_runs
        for r in range(0, len(removed_runs), 2):
            add_descent(removed, removed_runs[r], removed_runs[r + 1])
    return RunAllocations(
        [Allocation(blocks, 0, []) for blocks in joined],
        len(allocations),
        removed,
        result.kv_events,
        result.events,
        result.stats,
        result.cost,
    )
