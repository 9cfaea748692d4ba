"""The fast-forward planner: a run of pure decode steps taken in closed form.

`plan_jump` plans the decode steps from now, across block boundaries or stopped before
the first (`MockEngine.fast_forward` says when the engine may take them, and which);
`kvpool.engine.execution.apply_jump` applies a plan once its allocations are made.
setup.py compiles this module with mypyc.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.engine.request import EngineRequest
from kvpool.engine.timing import StepTiming
from kvpool.engine.work import decode_work
from kvpool.manager.types import DecodeStretch
from kvpool.workloads.tokens import segment_span

_NO_MEMBERS: list[int] = []  # never changed: the members of a step in which no block changes
_NO_TOKENS = range(0)  # the new tokens of a request no slot of a stretch names


def decode_growth(running: list[EngineRequest], block_size: int, finishing: bool = False) -> int:
    """How many tables grow in the next step if it is a pure decode step in which no
    request samples its last token (with ``finishing``: in which some may; each growth
    takes one fresh block); -1 if it is not one. `plan_jump` across block boundaries
    (with the same ``finishing``) plans no step exactly when this is -1 or the growths
    do not fit, so a caller that may not jump for another reason asks this first."""
    grows = 0
    last = 0 if finishing else 1  # the fewest tokens a request may have left to sample
    for request in running:
        tokens = request.num_tokens
        if not request.is_decoding:
            return -1
        if request.output_length - request.num_output - 1 < last:
            return -1
        if request.num_blocks * block_size - tokens + 1 == 0:
            grows += 1
    return grows


class DecodeJump:
    """A run of decode steps (`plan_jump`): how many steps, the clock, busy time and
    inter-token gaps they add, and the allocations of the steps in which some request's
    table grows or a block fills (none for a jump that stops before its first), as one
    `DecodeStretch`. A jump planned with ``finishing`` may end with a step in which
    some requests sample their last token (``finished``)."""

    __slots__ = (
        "active",
        "appends",
        "busy",
        "clock",
        "finished",
        "first_end",
        "gaps",
        "group_active",
        "group_ends",
        "group_steps",
        "members",
        "sent",
        "step_ends",
        "stretch",
        "taken",
        "targets",
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
        self.members: list[int] = []
        """The running index of each slot (a table that grows or a block that fills), in
        order: step by step, in running order within a step."""
        self.targets: list[int] = []
        """Each slot's token count (the table holds and has computed that many)."""
        self.appends: list[int] = []
        """Each slot's generated tokens the manager hears with it."""
        self.step_ends: list[int] = []
        """Per step with slots (a *group*): the end of its slots in ``members``."""
        self.group_steps: list[int] = []
        """The step (0 first) of each group."""
        self.group_ends: list[float] = []
        """The clock at the end of each group's step."""
        self.group_active: list[int] = []
        """The active blocks after each group's step."""
        self.stretch: DecodeStretch | None = None
        """The groups' allocations, for `KvClient.allocate_stretch` (None: no group)."""
        self.sent: list[int] = []
        """Each running request's ``num_sent`` once the groups are allocated."""
        self.finished: list[int] = []
        """The running indexes, in order, of the requests that sample their last token in
        the jump's last step (and so finish then); empty but with ``finishing``."""


def plan_jump(
    running: list[EngineRequest],
    block_size: int,
    caching: bool,
    clock: float,
    until: float,
    active: int,
    capacity: int,
    timing: StepTiming,
    varies: bool,
    usage_matters: bool,
    busy: float,
    max_steps: int,
    cross_boundaries: bool,
    finishing: bool = False,
) -> DecodeJump:
    """Plan the decode steps that start before ``until`` while every running request
    decodes, none samples its last token, and every table that grows gets its block
    (each growth takes one fresh block, which fits while ``active < capacity``: the
    free and evictable blocks); without ``cross_boundaries``, also before the first
    step in which a table grows or a block fills, so the jump makes no KV call. Across
    block boundaries, the requests that reach one in a step are that step's
    allocations, in running order,
    each with the tokens generated since the manager last heard (``num_sent`` moves as
    `EngineRequest.take_pending` would move it; the plan's ``sent``, which the caller
    applies once the allocations are made). Each step's duration is the timing model's
    for that step (``varies``: it reads the context; ``usage_matters``: it reads the
    active blocks, which change only at a growth); at most ``max_steps`` steps.
    ``busy`` is the busy time so far: each step's duration is added to it and to the
    clock one at a time, so both are bit for bit those of single steps. Nothing else
    changes; taken 0 if the next step is not such a step.

    With ``finishing`` (and ``cross_boundaries``) the jump may also take the step in
    which the first requests sample their last token, as its last step: those requests
    are the plan's ``finished``, for the caller to finish as `step` would (their last
    token is never computed, so they take part in that step's slots as any other).
    """
    plan = DecodeJump(clock, active)
    n = len(running)
    steps_max = -1
    context = 0
    first_grow: list[int] = []
    first_fill: list[int] = []
    # A request's table grows every block_size steps from its first growth, and with
    # caching a block fills every block_size steps from its first fill: the requests
    # with a slot in step s are among those listed under s % block_size, in running
    # order (a slot's step is known from its residue, not kept in a heap).
    at: dict[int, list[int]] = {}
    never = 1 << 62
    finishing = finishing and cross_boundaries
    last = 0 if finishing else 1  # the fewest tokens a request may have left to sample
    lefts: list[int] = []
    for index in range(n):
        request = running[index]
        tokens = request.num_tokens
        if not request.is_decoding:
            return plan  # a prefill chunk, or recomputing
        left = request.output_length - request.num_output - 1
        if left < last:
            return plan
        lefts.append(left)
        if steps_max < 0 or left < steps_max:
            steps_max = left
        context += tokens
        # step s computes token num_tokens + s - 1: the table grows once that passes its
        # slots (grow >= 0: the table holds the computed tokens), and with caching a
        # block fills when it ends one
        grow = request.num_blocks * block_size - tokens + 1
        first_grow.append(grow)
        at.setdefault(grow % block_size, []).append(index)
        if caching:
            fill = -tokens % block_size
            first_fill.append(fill)
            if fill != grow % block_size:
                at.setdefault(fill, []).append(index)
        else:
            first_fill.append(never)
    listed = sorted(at)  # the residues that list a request, in step order
    position = 0  # the residue of ``next_event`` below, in ``listed``
    sent = [request.num_sent for request in running]
    slot_members = plan.members
    targets = plan.targets
    appends = plan.appends
    duration = timing.duration(decode_work(n, context, active, capacity, block_size))
    gaps = plan.gaps
    # Consecutive steps mostly end with the same gap: it is counted here and added to
    # ``gaps`` when another follows (first-seen order kept), not boxed into the dict
    # once per step.
    last_gap = 0.0
    last_count = 0
    step = 0
    # Step ``left`` is the one in which a request samples its last token.
    final_step = steps_max
    if finishing:
        steps_max += 1
    if max_steps < steps_max:
        steps_max = max_steps
    # The next step whose residue lists a request (one that may grow or fill then): the
    # steps before it build nothing (no list, no slot), only the clock and the gaps.
    next_event = listed[0] if listed else never
    while step < steps_max and clock < until:
        members: list[int] = _NO_MEMBERS
        grows = 0
        if step == next_event:
            residue = listed[position]
            position = position + 1 if position + 1 < len(listed) else 0
            following = listed[position] - residue
            next_event = step + (following if following > 0 else following + block_size)
            # empty when every listed request's first slot is still to come
            members = []
            for index in at[residue]:
                grow = first_grow[index]
                grows_now = step >= grow and (step - grow) % block_size == 0
                fill = first_fill[index]
                if grows_now or (step >= fill and (step - fill) % block_size == 0):
                    members.append(index)
                    if grows_now:
                        grows += 1
            if members and not cross_boundaries:
                break  # the step changes a block: it makes a KV call
            if grows and active + grows > capacity:
                break  # a growth would not fit: the step preempts
        if members:
            for index in members:
                request = running[index]
                target = request.num_tokens + step
                told = target - request.prompt_length
                if told < sent[index]:
                    raise RuntimeError(f"{request.request_id}: the manager heard of more tokens")
                slot_members.append(index)
                targets.append(target)
                appends.append(told - sent[index])
                sent[index] = told
            active += grows
        if (varies and step) or (grows and usage_matters):
            work = decode_work(n, context + step * n, active, capacity, block_size)
            duration = timing.duration(work)
        start = clock
        clock += duration
        busy += duration
        if step:
            gap = clock - start
            if last_count and gap == last_gap:
                last_count += n
            else:
                if last_count:
                    gaps[last_gap] = gaps.get(last_gap, 0) + last_count
                last_gap = gap
                last_count = n
        else:
            plan.first_end = clock
        if members:
            plan.step_ends.append(len(slot_members))
            plan.group_steps.append(step)
            plan.group_ends.append(clock)
            plan.group_active.append(active)
        step += 1
    if last_count:
        gaps[last_gap] = gaps.get(last_gap, 0) + last_count
    plan.taken = step
    plan.sent = sent
    if finishing and step == final_step + 1:
        plan.finished = [index for index in range(n) if lefts[index] == final_step]
    if plan.step_ends:
        plan.stretch = _stretch(running, plan, sent)
    plan.clock = clock
    plan.busy = busy
    plan.active = active
    return plan


def _stretch(running: list[EngineRequest], plan: DecodeJump, sent: list[int]) -> DecodeStretch:
    """The plan's slots as a `DecodeStretch` naming only the requests that take part
    (a jump's slots are a few of a large batch), each with its generated tokens over
    the whole plan as one span."""
    position = [-1] * len(running)  # running index -> the request's index in the stretch
    request_ids: list[str] = []
    new_tokens: list[Sequence[int]] = []
    members: list[int] = []
    for index in plan.members:
        member = position[index]
        if member < 0:
            member = position[index] = len(request_ids)
            request = running[index]
            since = request.num_sent
            request_ids.append(request.request_id)
            new_tokens.append(
                segment_span(request.output_seed, request.output_length, since, sent[index])
                if since < sent[index]
                else _NO_TOKENS
            )
        members.append(member)
    return DecodeStretch(
        request_ids, new_tokens, members, plan.targets, plan.appends, plan.step_ends
    )
