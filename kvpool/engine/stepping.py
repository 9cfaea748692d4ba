"""The engine's per-request bookkeeping of a step, as plain functions over its requests.

Everything `MockEngine` does for every running request every step lives here: which
requests fit the step without a KV call, what the step computed (`StepWork`), what it
did to each request, and the closed-form jump over decode-only steps. No I/O and no
awaiting: the engine awaits its KV client between these calls. setup.py compiles this
module, `kvpool.engine.request` and `kvpool.engine.metrics` with mypyc, so these loops
run as C; interpreted (``KVPOOL_PURE_PYTHON=1``, no compiler) they do the same.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool.engine.metrics import EngineStats
from kvpool.engine.request import EngineRequest
from kvpool.engine.timing import StepTiming, StepWork
from kvpool.events import KVEvent
from kvpool.manager.types import ManagerStats, SlotRequest, StepAllocations, StepUpdate
from kvpool.workloads.tokens import segment_span


def needs_call(request: EngineRequest, target: int, block_size: int, caching: bool) -> bool:
    """Whether scheduling ``request`` through ``target`` tokens needs the KV manager: its
    table must grow, or with prefix caching a block fills (it turns cache-visible at
    schedule time, as in vLLM)."""
    if -(-target // block_size) > request.num_blocks:
        return True
    return caching and target // block_size > request.num_computed // block_size


def schedule_fitting(
    running: list[EngineRequest],
    start: int,
    budget: int,
    scheduled: dict[EngineRequest, int],
    block_size: int,
    caching: bool,
) -> tuple[int, int]:
    """Schedule ``running[start:]`` in order while the budget lasts and each request's
    tokens fit its table without a KV call; return (the index of the first request that
    needs one, or ``len(running)``, and the budget left).
    """
    i = start
    count = len(running)
    while i < count and budget > 0:
        request = running[i]
        num_new = min(request.num_tokens - request.num_computed, budget)
        if needs_call(request, request.num_computed + num_new, block_size, caching):
            break
        scheduled[request] = num_new
        budget -= num_new
        i += 1
    return i, budget


def plan_slots(
    running: list[EngineRequest], start: int, budget: int, block_size: int, caching: bool
) -> list[tuple[int, int]]:
    """The requests from ``running[start]`` on that need a KV call this step if every
    allocation fits, as (index, tokens to allocate through), in order: the budget is
    spent as `schedule_fitting` spends it, so those that fit are scheduled as planned."""
    plan: list[tuple[int, int]] = []
    i = start
    count = len(running)
    while i < count and budget > 0:
        request = running[i]
        num_new = min(request.num_tokens - request.num_computed, budget)
        target = request.num_computed + num_new
        if needs_call(request, target, block_size, caching):
            plan.append((i, target))
        budget -= num_new
        i += 1
    return plan


def step_work(
    scheduled: dict[EngineRequest, int], active_blocks: int, capacity: int, block_size: int
) -> StepWork:
    """What the scheduled requests compute this step, as the timing models read it."""
    prefill_tokens = decode_seqs = 0
    prefill_requests = prompt_start = prompt_end = emitting = context_tokens = 0
    decoding = decode_context = 0
    for request, num_new in scheduled.items():
        before = request.num_computed
        tokens = request.num_tokens
        # a decode computes the one token sampled last step (a recomputation that
        # happens to have one token left costs the same, and counts as one)
        if num_new == 1 and request.num_output and before + 1 == tokens:
            decode_seqs += 1
        else:
            prefill_tokens += num_new
        prompt = request.spec.input_length
        if before < prompt:  # prompt tokens computed (Dynamo's prefill batch)
            prefill_requests += 1
            prompt_start += before
            prompt_end += min(before + num_new, prompt)
        if before + num_new == tokens:  # samples a token this step
            emitting += 1
            context_tokens += tokens
            if request.num_output:  # and sampled before: decoding, or done recomputing
                decoding += 1
                decode_context += tokens
    return StepWork(
        prefill_tokens=prefill_tokens,
        decode_seqs=decode_seqs,
        prefill_requests=prefill_requests,
        prompt_start=prompt_start,
        prompt_end=prompt_end,
        emitting=emitting,
        context_tokens=context_tokens,
        decoding=decoding,
        decode_context_tokens=decode_context,
        active_blocks=active_blocks,
        capacity=capacity,
        block_size=block_size,
    )


def decode_work(
    requests: int, context_tokens: int, active_blocks: int, capacity: int, block_size: int
) -> StepWork:
    """What a step in which each of ``requests`` running requests decodes one token
    computes, as the timing models read it."""
    return StepWork(
        decode_seqs=requests,
        emitting=requests,
        context_tokens=context_tokens,
        decoding=requests,
        decode_context_tokens=context_tokens,
        active_blocks=active_blocks,
        capacity=capacity,
        block_size=block_size,
    )


def apply_step(
    scheduled: dict[EngineRequest, int], now: float, stats: EngineStats, rank: int
) -> tuple[list[StepUpdate], list[str]]:
    """Apply a step that ended at ``now`` to its requests and ``stats``; return the
    manager's updates (the finished requests' frees, in schedule order) and the ids of
    the requests that finished.

    Every block the computed tokens fill was made visible when they were scheduled. A
    request that computed all its tokens samples one: its first (TTFT) or the next (an
    inter-token gap); its last finishes it, and that token is never computed, so it
    never reaches the manager. The other generated tokens reach it with the allocation
    that needs them (`EngineRequest.take_pending`).
    """
    finished: list[str] = []
    updates: list[StepUpdate] = []
    same_gap = 0  # requests that sampled last at `last`: one ITL count for all of them
    last = -1.0
    for request, num_new in scheduled.items():
        computed = request.num_computed + num_new
        request.num_computed = computed
        if computed < request.num_tokens:  # a prefill chunk: nothing to sample yet
            continue
        first_token_s = request.first_token_s
        if first_token_s is None:
            request.first_token_s = first_token_s = now
            stats.ttft_s.append(now - request.arrival_s)
        elif request.last_token_s == last:
            same_gap += 1
        else:
            if same_gap:
                stats.record_itl(now - last, same_gap)
            last = request.last_token_s
            same_gap = 1
        request.last_token_s = now
        spec = request.spec
        output_length = spec.output.length
        request.num_output += 1
        stats.generated_tokens += 1
        if request.num_output < output_length:
            request.num_tokens += 1
            continue
        updates.append(StepUpdate(request.request_id, [], -1, True))
        request.finish_s = now
        finished.append(request.request_id)
        stats.completed += 1
        stats.prompt_tokens += spec.input_length
        stats.latency_s.append(now - request.arrival_s)
        if output_length > 1:
            stats.tpot_s.append((now - first_token_s) / (output_length - 1))
        stats.requests.append(request.record(rank))
    if same_gap:
        stats.record_itl(now - last, same_gap)
    return updates, finished


def plan_jump(running: list[EngineRequest], block_size: int, caching: bool) -> tuple[int, int]:
    """How many pure decode steps every running request allows from now, and their
    tokens summed (the first step's context); (0, 0) if the next step is not one.

    Each must be decoding (it computed every token but the one it sampled last), and
    its steps end before the one that samples its last token, outgrows its table, or
    with prefix caching fills a block.
    """
    steps = -1
    context = 0
    for request in running:
        tokens = request.num_tokens
        if not request.num_output or request.num_computed + 1 != tokens:
            return 0, 0  # not decoding (a prefill chunk, or recomputing)
        left = min(
            request.spec.output.length - request.num_output - 1,
            request.num_blocks * block_size - tokens + 1,
        )
        if caching:
            left = min(left, -tokens % block_size)
        if left <= 0:
            return 0, 0
        if steps < 0 or left < steps:
            steps = left
        context += tokens
    return max(steps, 0), context


def decode_growth(running: list[EngineRequest], block_size: int) -> int:
    """How many tables grow in the next step if it is a pure decode step in which no
    request samples its last token (each growth takes one fresh block); -1 if it is not
    one. `plan_crossing` plans no step exactly when this is -1 or the growths do not
    fit, so a caller that may not jump for another reason asks this first."""
    grows = 0
    for request in running:
        tokens = request.num_tokens
        if not request.num_output or request.num_computed + 1 != tokens:
            return -1
        if request.spec.output.length - request.num_output - 1 <= 0:
            return -1
        if request.num_blocks * block_size - tokens + 1 == 0:
            grows += 1
    return grows


def apply_jump(
    running: list[EngineRequest], stats: EngineStats, taken: int, first_end: float, end: float
) -> None:
    """Move every running request ``taken`` decode steps on: the first ended at
    ``first_end`` (its inter-token gap is each request's own), the last at ``end``."""
    for request in running:
        stats.record_itl(first_end - request.last_token_s)
        request.num_output += taken
        request.num_tokens += taken
        request.num_computed += taken
        request.last_token_s = end


class CrossingJump:
    """A run of decode steps that crosses block boundaries (`plan_crossing`): how many
    steps, the clock, busy time and inter-token gaps they add, and the allocations of
    the steps in which some request's table grows or a block fills."""

    __slots__ = (
        "active",
        "busy",
        "clock",
        "first_end",
        "gaps",
        "group_active",
        "group_ends",
        "group_members",
        "group_steps",
        "groups",
        "sent",
        "taken",
    )

    def __init__(self, clock: float, active: int) -> None:
        self.taken = 0
        self.clock = clock
        self.first_end = clock
        self.busy = 0.0
        self.active = active
        """The pool's active blocks after the last step's allocations."""
        self.gaps: dict[float, int] = {}
        """Inter-token gaps of every step but the first (each request's own)."""
        self.groups: list[list[SlotRequest]] = []
        """One step's allocations each, for `KvClient.allocate_steps`."""
        self.group_members: list[list[int]] = []
        """The running indexes of each group's slots."""
        self.group_steps: list[int] = []
        """The step (0 first) of each group."""
        self.group_ends: list[float] = []
        """The clock at the end of each group's step."""
        self.group_active: list[int] = []
        """The active blocks after each group's step."""
        self.sent: list[int] = []
        """Each running request's ``num_sent`` once the groups are allocated."""


def plan_crossing(
    running: list[EngineRequest],
    block_size: int,
    caching: bool,
    clock: float,
    until: float,
    active: int,
    capacity: int,
    timing: StepTiming,
    varies: bool,
    busy: float,
    max_steps: int,
) -> CrossingJump:
    """Plan the decode steps that start before ``until`` while every running request
    decodes, none samples its last token, and every table that grows gets its block
    (each growth takes one fresh block, which fits while ``active < capacity``: the
    free and evictable blocks). Unlike `plan_jump` it crosses block boundaries: the
    requests that reach one in a step are that step's allocations, in running order,
    each with the tokens generated since the manager last heard (``num_sent`` moves as
    `EngineRequest.take_pending` would move it; the plan's ``sent``, which the caller
    applies once the allocations are made). Each step's duration is the timing model's
    for that step (``varies``: it reads the context; the active blocks change only at a
    growth); at most ``max_steps`` steps. ``busy`` is the busy time so far: each step's
    duration is added to it and to the clock one at a time, so both are bit for bit
    those of single steps. Nothing else changes; taken 0 if the next step is not such a
    step.
    """
    plan = CrossingJump(clock, active)
    n = len(running)
    steps_max = -1
    context = 0
    next_grow: list[int] = []
    next_fill: list[int] = []
    heap: list[tuple[int, int]] = []
    never = 1 << 62
    for index in range(n):
        request = running[index]
        tokens = request.num_tokens
        if not request.num_output or request.num_computed + 1 != tokens:
            return plan  # not decoding (a prefill chunk, or recomputing)
        left = request.spec.output.length - request.num_output - 1
        if left <= 0:
            return plan
        if steps_max < 0 or left < steps_max:
            steps_max = left
        context += tokens
        # step s computes token num_tokens + s - 1: the table grows once that passes its
        # slots, and with caching a block fills when it ends one
        grow = request.num_blocks * block_size - tokens + 1
        fill = -tokens % block_size if caching else never
        next_grow.append(grow)
        next_fill.append(fill)
        heap.append((min(grow, fill), index))
    heapq.heapify(heap)
    sent = [request.num_sent for request in running]
    duration = timing.duration(decode_work(n, context, active, capacity, block_size))
    gaps = plan.gaps
    step = 0
    if max_steps < steps_max:
        steps_max = max_steps
    while step < steps_max and clock < until:
        members: list[int] = []
        grows = 0
        while heap and heap[0][0] == step:
            index = heapq.heappop(heap)[1]
            members.append(index)
            if next_grow[index] == step:
                grows += 1
        if grows and active + grows > capacity:
            break  # a growth would not fit: the step preempts
        slots: list[SlotRequest] = []
        if members:
            for index in members:
                request = running[index]
                target = request.num_tokens + step
                told = target - request.spec.input_length
                since = sent[index]
                output = request.spec.output
                new_tokens: Sequence[int] = (
                    segment_span(output.seed, output.length, since, told) if since < told else []
                )
                sent[index] = told
                slots.append(SlotRequest(request.request_id, target, new_tokens))
                if next_grow[index] == step:
                    next_grow[index] = step + block_size
                if next_fill[index] == step:
                    next_fill[index] = step + block_size
                heapq.heappush(heap, (min(next_grow[index], next_fill[index]), index))
            active += grows
        if (varies and step) or grows:
            work = decode_work(n, context + step * n, active, capacity, block_size)
            duration = timing.duration(work)
        start = clock
        clock += duration
        busy += duration
        if step:
            gap = clock - start
            gaps[gap] = gaps.get(gap, 0) + n
        else:
            plan.first_end = clock
        if members:
            plan.groups.append(slots)
            plan.group_members.append(members)
            plan.group_steps.append(step)
            plan.group_ends.append(clock)
            plan.group_active.append(active)
        step += 1
    plan.taken = step
    plan.sent = sent
    plan.clock = clock
    plan.busy = busy
    plan.active = active
    return plan


def apply_crossing(
    plan: CrossingJump,
    results: list[StepAllocations],
    running: list[EngineRequest],
    stats: EngineStats,
    active: int,
    capacity: int,
) -> list[tuple[float, list[KVEvent]]]:
    """Apply a crossing jump whose allocations returned ``results``, ``active`` blocks
    before it of ``capacity``: the requests' blocks and counts, the stats and the
    samples. Returns each step's events that are not empty with the clock at that
    step's end, for the caller to publish as one batch each; the caller sets the clock
    (``plan.clock``) and the active count (``plan.active``)."""
    grown = active
    for members, result in zip(plan.group_members, results, strict=True):
        for index, allocation in zip(members, result.allocations, strict=True):
            running[index].num_blocks += len(allocation.block_ids)
            grown += len(allocation.block_ids)
    if grown != plan.active:
        raise RuntimeError(f"planned {plan.active} active blocks, the pool has {grown}")
    for request, num_sent in zip(running, plan.sent, strict=True):
        request.num_sent = num_sent
    n = len(running)
    taken = plan.taken
    stats.busy_s = plan.busy
    stats.steps += taken
    stats.decode_tokens += n * taken
    stats.generated_tokens += n * taken
    for gap, count in plan.gaps.items():
        stats.record_itl(gap, count)
    apply_jump(running, stats, taken, plan.first_end, plan.clock)
    if not plan.groups or plan.group_steps[0]:
        stats.record_sample(
            plan.first_end, active / capacity, stats.prefix_query_tokens, stats.prefix_hit_tokens
        )
    batches: list[tuple[float, list[KVEvent]]] = []
    for end, blocks, result in zip(plan.group_ends, plan.group_active, results, strict=True):
        counters = result.stats
        read_counters(stats, counters)
        if close_batch(stats) and result.events:
            batches.append((end, result.events))
        stats.record_sample(
            end, blocks / capacity, counters.prefix_query_tokens, counters.prefix_hit_tokens
        )
    return batches


def read_counters(stats: EngineStats, counters: ManagerStats) -> None:
    """Copy the counters the engine does not keep itself: the pool counts evictions, the
    manager prefix-cache queries, hits and router-visible events."""
    stats.evictions = counters.evictions
    stats.prefix_query_tokens = counters.prefix_query_tokens
    stats.prefix_hit_tokens = counters.prefix_hit_tokens
    stats.kv_events = counters.kv_events


def close_batch(stats: EngineStats) -> bool:
    """At a step's end, once its counters are read: True (and one more batch counted) if
    the step told a router something, which its KV calls' events then hold (none when
    the manager builds no events). Every KV call that queues an event drains it, and the
    engine reads its counters, within the step."""
    if stats.kv_events == stats.kv_events_batched:
        return False
    stats.kv_events_batched = stats.kv_events
    stats.event_batches += 1
    return True
