"""The fast-forward planner: a run of pure decode steps taken in closed form.

`plan_jump` plans the decode steps from now, across block boundaries or stopped before
the first (`MockEngine.fast_forward` says when the engine may take them, and which);
`kvpool.engine.execution.apply_jump` applies a plan once its allocations are made.
setup.py compiles this module with mypyc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from mypy_extensions import i64

from kvpool.engine.request import EngineRequest
from kvpool.engine.timing import StepTiming
from kvpool.engine.work import decode_work
from kvpool.manager.types import DecodeStretch
from kvpool.workloads.tokens import segment_span

_NONE: list[int] = []  # never changed: a plan's slot lists until its first slot
_NEVER: Final = 1 << 62  # a step no jump reaches
_NO_ENDS: list[float] = []  # never changed: a plan's group ends until its first slot
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
    some requests sample their last token (``finished``).

    The slots are kept in the stretch's own terms (each taking part request once, a
    slot naming it by its place there), so the stretch is the plan's lists, not a copy
    of them; a jump without slots builds none of them."""

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
        "indexes",
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
        self.members: list[int] = _NONE
        """Each slot's (a table that grows or a block that fills) request, as its place
        in ``indexes``, in order: step by step, in running order within a step."""
        self.indexes: list[int] = _NONE
        """The running index of each request with a slot, in order of its first slot."""
        self.targets: list[int] = _NONE
        """Each slot's token count (the table holds and has computed that many)."""
        self.appends: list[int] = _NONE
        """Each slot's generated tokens the manager hears with it."""
        self.step_ends: list[int] = _NONE
        """Per step with slots (a *group*): the end of its slots in ``members``."""
        self.group_steps: list[int] = _NONE
        """The step (0 first) of each group."""
        self.group_ends: list[float] = _NO_ENDS
        """The clock at the end of each group's step."""
        self.group_active: list[int] = _NONE
        """The active blocks after each group's step."""
        self.stretch: DecodeStretch | None = None
        """The groups' allocations, for `KvClient.allocate_stretch` (None: no group)."""
        self.sent: list[int] = _NONE
        """Each request of ``indexes``' ``num_sent`` once the groups are allocated."""
        self.finished: list[int] = _NONE
        """The running indexes, in order, of the requests that sample their last token in
        the jump's last step (and so finish then); empty but with ``finishing``."""

    def open_slots(self) -> None:
        """Give the plan lists of its own for its slots and groups (at its first slot;
        until then they are shared empty ones that nothing appends to)."""
        self.members = []
        self.indexes = []
        self.targets = []
        self.appends = []
        self.step_ends = []
        self.group_steps = []
        self.group_ends = []
        self.group_active = []
        self.sent = []


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
    # The counts below are machine words (i64): a jump's steps, a few requests, a block
    # size. Compiled, each comparison and addition is then one instruction, not a
    # tagged int's checks (the step loop runs once per step jumped: 432,000 on the
    # multi-turn trace).
    n: i64 = len(running)
    bs: i64 = block_size
    steps_max: i64 = -1
    context = 0
    # A request's table grows every block_size steps from its first growth, and with
    # caching a block fills every block_size steps from its first fill: the requests
    # with a slot in step s are among those listed under s % block_size. ``keys`` holds
    # residue * n + running index for each (a request at most twice: its growth's and
    # its fill's), sorted: by residue, then in running order.
    keys: list[int] = []
    finishing = finishing and cross_boundaries
    last: i64 = 0 if finishing else 1  # the fewest tokens a request may have left to sample
    for index in range(n):
        request = running[index]
        tokens: i64 = request.num_tokens
        if not request.is_decoding:
            return plan  # a prefill chunk, or recomputing
        left: i64 = request.output_length - request.num_output - 1
        if left < last:
            return plan
        if steps_max < 0 or left < steps_max:
            steps_max = left
        context += tokens
        # step s computes token num_tokens + s - 1: the table grows once that passes its
        # slots (grow >= 0: the table holds the computed tokens), and with caching a
        # block fills when it ends one
        grow: i64 = (request.num_blocks * bs - tokens + 1) % bs
        keys.append(grow * n + index)
        if caching:
            fill: i64 = -tokens % bs
            if fill != grow:
                keys.append(fill * n + index)
    keys.sort()
    num_keys: i64 = len(keys)
    position: i64 = 0  # the first key of ``next_event``'s residue
    duration = timing.duration(decode_work(n, context, active, capacity, block_size))
    gaps = plan.gaps
    # Consecutive steps mostly end with the same gap: it is counted here and added to
    # ``gaps`` when another follows (first-seen order kept), not boxed into the dict
    # once per step.
    last_gap = 0.0
    last_count: i64 = 0
    step: i64 = 0
    # Step ``left`` is the one in which a request samples its last token.
    final_step = steps_max
    if finishing:
        steps_max += 1
    if max_steps < steps_max:
        steps_max = max_steps
    opened = False  # whether the plan has lists of its own for slots (`open_slots`)
    # running index -> its place in the plan's ``indexes`` (-1: no slot yet)
    places: list[int] = _NONE
    # The next step whose residue lists a request (one that may grow or fill then): the
    # steps before it build nothing, only the clock and the gaps.
    next_event: i64 = keys[0] // n if num_keys else _NEVER
    while step < steps_max and clock < until:
        slots: i64 = 0
        grows: i64 = 0
        if step == next_event:
            residue: i64 = keys[position] // n
            end = position
            # which listed requests grow or fill now (none: their first is still to come)
            while True:
                index = keys[end] - residue * n
                slot = _slot(running[index], step, bs, caching)
                if slot:
                    slots += 1
                    if slot == 2:
                        grows += 1
                end += 1
                if end == num_keys or keys[end] // n != residue:
                    break
            if slots and not cross_boundaries:
                break  # the step changes a block: it makes a KV call
            if grows and active + grows > capacity:
                break  # a growth would not fit: the step preempts
            if slots:
                if not opened:
                    places = [-1] * n
                    plan.open_slots()
                    opened = True
                for key in range(position, end):
                    index = keys[key] - residue * n
                    request = running[index]
                    if _slot(request, step, bs, caching):
                        _add_slot(plan, places, index, request, step)
                active += grows
            position = end if end < num_keys else 0
            following: i64 = keys[position] // n - residue
            next_event = step + (following if following > 0 else following + bs)
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
        if slots:
            plan.step_ends.append(len(plan.members))
            plan.group_steps.append(step)
            plan.group_ends.append(clock)
            plan.group_active.append(active)
        step += 1
    if last_count:
        gaps[last_gap] = gaps.get(last_gap, 0) + last_count
    plan.taken = step
    if finishing and step == final_step + 1:
        plan.finished = [
            index
            for index in range(n)
            if running[index].output_length - running[index].num_output - 1 == final_step
        ]
    if opened:
        plan.stretch = _stretch(running, plan)
    plan.clock = clock
    plan.busy = busy
    plan.active = active
    return plan


def _slot(request: EngineRequest, step: i64, block_size: i64, caching: bool) -> i64:
    """Whether ``request``'s table grows in step ``step`` of a jump from now (2), a
    block of it fills then (1, with ``caching``), or neither (0)."""
    tokens: i64 = request.num_tokens
    grow: i64 = request.num_blocks * block_size - tokens + 1
    if step >= grow and (step - grow) % block_size == 0:
        return 2
    if caching and (step + tokens) % block_size == 0:
        return 1
    return 0


def _add_slot(
    plan: DecodeJump, places: list[int], index: int, request: EngineRequest, step: int
) -> None:
    """Append the slot of running request ``index`` in step ``step``: its target and
    the generated tokens the manager has not heard of (``num_sent`` as
    `EngineRequest.take_pending` would move it, kept in the plan's ``sent``)."""
    place = places[index]
    if place < 0:
        place = places[index] = len(plan.indexes)
        plan.indexes.append(index)
        plan.sent.append(request.num_sent)
    target = request.num_tokens + step
    told = target - request.prompt_length
    sent = plan.sent[place]
    if told < sent:
        raise RuntimeError(f"{request.request_id}: the manager heard of more tokens")
    plan.members.append(place)
    plan.targets.append(target)
    plan.appends.append(told - sent)
    plan.sent[place] = told


def _stretch(running: list[EngineRequest], plan: DecodeJump) -> DecodeStretch:
    """The plan's slots as a `DecodeStretch` naming only the requests that take part
    (a jump's slots are a few of a large batch), each with its generated tokens over
    the whole plan as one span."""
    request_ids: list[str] = []
    new_tokens: list[Sequence[int]] = []
    sent = plan.sent
    for place, index in enumerate(plan.indexes):
        request = running[index]
        since = request.num_sent
        request_ids.append(request.request_id)
        new_tokens.append(
            segment_span(request.output_seed, request.output_length, since, sent[place])
            if since < sent[place]
            else _NO_TOKENS
        )
    return DecodeStretch(
        request_ids, new_tokens, plan.members, plan.targets, plan.appends, plan.step_ends
    )
