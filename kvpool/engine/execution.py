"""What a step, or a jump over decode steps, does to its requests and the stats once its
KV calls are made: tokens computed and sampled, requests finished, gaps and samples
recorded. No I/O: the engine awaits its KV client around these. setup.py compiles this
module with mypyc.
"""

from __future__ import annotations

from kvpool.engine.fast_forward import DecodeJump
from kvpool.engine.metrics import EngineStats, close_batch, read_counters
from kvpool.engine.request import EngineRequest
from kvpool.events import KVEvent
from kvpool.manager.types import RunAllocations, StepUpdate


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
        request.num_output += 1
        stats.generated_tokens += 1
        if request.num_output < request.output_length:
            request.num_tokens += 1
            continue
        updates.append(StepUpdate(request.request_id, [], -1, True))
        finished.append(request.request_id)
        _finished(request, stats, now, rank)
    if same_gap:
        stats.record_itl(now - last, same_gap)
    return updates, finished


def _advance_decodes(
    running: list[EngineRequest], stats: EngineStats, taken: int, first_end: float, end: float
) -> None:
    """Move every running request ``taken`` decode steps on: the first ended at
    ``first_end`` (its inter-token gap is each request's own), the last at ``end``.
    Requests that sampled last at the same time (all but the newest, mostly: they
    decoded together) have the same first gap, counted once for all of them in a row
    (`apply_step`'s rule: the same counts, first seen in the same order)."""
    same = 0  # requests in a row that sampled last at ``last``
    last = 0.0
    for request in running:
        sampled = request.last_token_s
        if same and sampled == last:
            same += 1
        else:
            if same:
                stats.record_itl(first_end - last, same)
            last = sampled
            same = 1
        request.num_output += taken
        request.num_tokens += taken
        request.num_computed += taken
        request.last_token_s = end
    if same:
        stats.record_itl(first_end - last, same)


def apply_jump(
    plan: DecodeJump,
    running: list[EngineRequest],
    stats: EngineStats,
    active: int,
    capacity: int,
    rank: int,
    sample: bool = True,
) -> None:
    """Apply a jump (`kvpool.engine.fast_forward.plan_jump`) to its requests, ``active``
    blocks before it of ``capacity``: their blocks and counts, the clock's stats (steps,
    tokens, gaps, busy time) and (``sample``) the first step's usage sample
    (`first_sample`: a chain of jumps, whose later jumps' ``active`` the manager's frees
    decide, records it once they are known, `samples_first`); what its allocations
    returned is applied by `apply_groups` (at once, or when a later call that carried
    them returns). The caller sets the clock (``plan.clock``) and the active count
    (``plan.active``).

    A jump whose last step finishes requests (``plan.finished``) finishes them here as
    `apply_step` would (their records, in running order, with the worker ``rank``); the
    caller then frees them in the manager (with the jump's allocations or alone) and
    ends that step as a single step ends: its batch (the events `apply_groups` returns
    second, then the free's) and its usage sample come after the free, so they are left
    out here."""
    # Each request's growths (one block each) and heard tokens, as the plan has them
    # (the caller checked the allocations' blocks against the plan's).
    indexes = plan.indexes
    grown = plan.grown
    sent = plan.sent
    for place in range(len(indexes)):
        request = running[indexes[place]]
        request.num_blocks += grown[place]
        request.num_sent = sent[place]
    n = len(running)
    taken = plan.taken
    stats.busy_s = plan.busy
    stats.steps += taken
    stats.decode_tokens += n * taken
    stats.generated_tokens += n * taken
    for gap, count in plan.gaps.items():
        stats.record_itl(gap, count)
    _advance_decodes(running, stats, taken, plan.first_end, plan.clock)
    finished = plan.finished
    if finished:
        _finish(running, finished, stats, plan.clock, rank)
    if sample:
        first_sample(plan, stats, active, capacity)


def first_sample(plan: DecodeJump, stats: EngineStats, active: int, capacity: int) -> None:
    """The usage sample of a jump's first step, ``active`` blocks of ``capacity`` before
    it, if it has one (`samples_first`)."""
    if samples_first(plan):
        stats.record_sample(
            plan.first_end, active / capacity, stats.prefix_query_tokens, stats.prefix_hit_tokens
        )


def samples_first(plan: DecodeJump) -> bool:
    """Whether a jump's first step has a usage sample of its own: not when a group
    (`apply_groups`) or the free after a finishing step samples it."""
    return (not plan.step_ends or plan.group_steps[0] > 0) and _last_sampled(plan) > 0


def _last_sampled(plan: DecodeJump) -> int:
    """The steps of ``plan`` sampled with it: a finishing jump's last step is sampled
    after its free, by the caller."""
    return plan.taken - 1 if plan.finished else plan.taken


def apply_groups(
    plan: DecodeJump,
    result: RunAllocations | None,
    stats: EngineStats,
    capacity: int,
    first: int = 0,
    shift: int = 0,
    samples: tuple[list[float], list[float]] | None = None,
) -> tuple[list[tuple[float, list[KVEvent]]], list[KVEvent]]:
    """Apply what a jump's allocations returned once `apply_jump` applied the jump: each
    group's counters, batch count and usage sample. Returns each step's events that are
    not empty with the clock at that step's end, for the caller to publish as one batch
    each, and the events of a finishing jump's last step. Nothing else records a sample
    in between, so the samples stay in the clock's order however late the result comes.

    ``result``'s groups from ``first`` on are the plan's (a chain's holds every jump's);
    it is None if the plan has no group, and may go on past the plan's groups (a jump
    cut short applies its first groups). ``shift``: how many blocks the plan's active
    counts overstate (a chain's frees before it). With ``samples``, the samples' times
    and usages are appended there, for the caller to record with the prefix counters
    (which a stretch leaves as they are)."""
    groups = len(plan.step_ends)
    batches: list[tuple[float, list[KVEvent]]] = []
    held: list[KVEvent] = []
    if not groups:
        return batches, held
    if result is None:
        raise RuntimeError("a jump across block boundaries applied without its allocations")
    last_sampled = _last_sampled(plan)
    # Only the event counter moves from group to group (a stretch has no first
    # allocation, so the prefix counters stay; evictions are read once, for the end).
    read_counters(stats, result.stats)
    queries = stats.prefix_query_tokens
    hits = stats.prefix_hit_tokens
    kv_events = result.kv_events
    events = result.events
    pending = 0  # the next entry of ``events`` (by group, in order)
    while pending < len(events) and events[pending][0] < first:
        pending += 1
    # each group's usage sample, recorded together after the loop (nothing in it reads
    # the samples): one array extension each, not four appends a group
    times, usages = ([], []) if samples is None else samples
    group_ends = plan.group_ends
    group_steps = plan.group_steps
    group_active = plan.group_active
    last_active = -1
    for group in range(groups):
        end = group_ends[group]
        stats.kv_events = kv_events[first + group]
        queued: list[KVEvent] = []
        if pending < len(events) and events[pending][0] == first + group:
            queued = events[pending][1]
            pending += 1
        if group_steps[group] == last_sampled:
            held = queued  # a finishing jump's last step: batched after its free
            break
        if close_batch(stats) and queued:
            batches.append((end, queued))
        after = group_active[group] - shift
        if after != last_active:  # a group that only fills blocks repeats the usage
            times.append(end)
            usages.append(after / capacity)
            last_active = after
    if samples is None:
        stats.record_samples(times, usages, queries, hits)
    return batches, held


def _finish(
    running: list[EngineRequest], finished: list[int], stats: EngineStats, now: float, rank: int
) -> None:
    """The requests at running indexes ``finished`` sampled their last token in the step
    that ended at ``now`` (and were moved on by it as decoding requests): finish them as
    `apply_step` does. The last token is never computed, so it adds no token."""
    for index in finished:
        request = running[index]
        request.num_tokens -= 1
        _finished(request, stats, now, rank)


def _finished(request: EngineRequest, stats: EngineStats, now: float, rank: int) -> None:
    """``request`` sampled its last token at ``now``: its finish, stats and record."""
    output_length = request.output_length
    request.finish_s = now
    stats.completed += 1
    stats.prompt_tokens += request.prompt_length
    stats.latency_s.append(now - request.arrival_s)
    if output_length > 1:
        first_token_s = request.first_token_s
        assert first_token_s is not None  # it sampled its first token before its last
        stats.tpot_s.append((now - first_token_s) / (output_length - 1))
    stats.requests.append(request.record(rank))
