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
from kvpool.manager.types import DecodeRun
from kvpool.workloads.tokens import segment_span

_NONE: list[int] = []  # never changed: a plan's request and group lists until its first slot
_NEVER: Final = 1 << 62  # a step no jump reaches
_NO_ENDS: list[float] = []  # never changed: a plan's group ends until its first slot
_NO_TOKENS = range(0)  # a request's new tokens when the manager heard them all already


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
    `DecodeRun`: in closed form, each request's growths and fills an arithmetic
    progression, no slot spelled out. A jump planned with ``finishing`` may end with a
    step in which some requests sample their last token (``finished``)."""

    __slots__ = (
        "active",
        "busy",
        "clock",
        "finished",
        "first_end",
        "gaps",
        "group_active",
        "group_ends",
        "group_steps",
        "grown",
        "indexes",
        "run",
        "sent",
        "step_ends",
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
        self.step_ends: list[int] = _NONE
        """Per step with slots (a *group*; a slot: a table that grows or a block that
        fills): the slots of the groups up to it, in all."""
        self.group_steps: list[int] = _NONE
        """The step (0 first) of each group."""
        self.group_ends: list[float] = _NO_ENDS
        """The clock at the end of each group's step."""
        self.group_active: list[int] = _NONE
        """The active blocks after each group's step."""
        self.indexes: list[int] = _NONE
        """The running index of each request with a slot, in running order."""
        self.grown: list[int] = _NONE
        """Each request of ``indexes``' blocks the jump adds (one a growth)."""
        self.sent: list[int] = _NONE
        """Each request of ``indexes``' ``num_sent`` once the groups are allocated."""
        self.run: DecodeRun | None = None
        """The groups' allocations, for `KvClient.allocate_run` (None: no group, or
        planned without ``spell``)."""
        self.finished: list[int] = _NONE
        """The running indexes, in order, of the requests that sample their last token in
        the jump's last step (and so finish then); empty but with ``finishing``."""

    def open_groups(self) -> None:
        """Give the plan lists of its own for its groups (at its first slot; until then
        they are shared empty ones that nothing appends to)."""
        self.step_ends = []
        self.group_steps = []
        self.group_ends = []
        self.group_active = []


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
    spell: bool = True,
) -> DecodeJump:
    """Plan the decode steps that start before ``until`` while every running request
    decodes, none samples its last token, and every table that grows gets its block
    (each growth takes one fresh block, which fits while ``active < capacity``: the
    free and evictable blocks); without ``cross_boundaries``, also before the first
    step in which a table grows or a block fills, so the jump makes no KV call. Across
    block boundaries, the requests that reach one in a step are that step's
    allocations (its slots), in running order, each hearing the tokens generated since
    the manager last heard (``num_sent`` moves as `EngineRequest.take_pending` would
    move it; the plan's ``sent``, which the caller applies once the allocations are
    made): the plan's ``run``, each request's slots in closed form. Each step's
    duration is the timing model's for that step (``varies``: it reads the context;
    ``usage_matters``: it reads the active blocks, which change only at a growth); at
    most ``max_steps`` steps.
    ``busy`` is the busy time so far: each step's duration is added to it and to the
    clock one at a time, so both are bit for bit those of single steps. Nothing else
    changes; taken 0 if the next step is not such a step.

    With ``finishing`` (and ``cross_boundaries``) the jump may also take the step in
    which the first requests sample their last token, as its last step: those requests
    are the plan's ``finished``, for the caller to finish as `step` would (their last
    token is never computed, so they take part in that step's slots as any other).

    Without ``spell`` the plan's ``run`` stays None even with groups (its ``indexes``,
    ``grown`` and ``sent`` are set): the later jumps of a chain, whose allocations go
    to the manager as one run (`chain_run`).
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
    opened = False  # whether the plan has lists of its own for groups (`open_groups`)
    total: i64 = 0  # the slots so far
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
                slot = decode_slot(running[index], step, bs, caching)
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
                    plan.open_groups()
                    opened = True
                total += slots
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
            plan.step_ends.append(total)
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
        run = _run(running, plan, bs, caching, spell)
        plan.run = run if spell else None
    plan.clock = clock
    plan.busy = busy
    plan.active = active
    return plan


def decode_slot(request: EngineRequest, step: i64, block_size: i64, caching: bool) -> i64:
    """Whether ``request``'s table grows in step ``step`` of a jump from now (2), a
    block of it fills then (1, with ``caching``), or neither (0)."""
    tokens: i64 = request.num_tokens
    grow: i64 = request.num_blocks * block_size - tokens + 1
    if step >= grow and (step - grow) % block_size == 0:
        return 2
    if caching and (step + tokens) % block_size == 0:
        return 1
    return 0


def _run(
    running: list[EngineRequest], plan: DecodeJump, bs: i64, caching: bool, spell: bool
) -> DecodeRun:
    """The plan's slots as a `DecodeRun` naming only the requests that take part (a
    jump's slots are a few of a large batch), in running order: each one's first growth
    and fill steps, and its generated tokens through its last slot as one span (without
    ``spell``, an empty one); the plan's ``indexes``, ``grown`` and ``sent`` set with
    it."""
    taken: i64 = plan.taken
    indexes: list[int] = []
    grown: list[int] = []
    sent: list[int] = []
    members = _Members(spell)
    for index in range(len(running)):
        request = running[index]
        blocks = members.add(
            request, request.num_tokens, request.num_blocks, request.num_sent, taken, bs, caching
        )
        if blocks >= 0:
            indexes.append(index)
            grown.append(blocks)
            sent.append(members.told)
    plan.indexes = indexes
    plan.grown = grown
    plan.sent = sent
    return members.run(taken)


def chain_run(
    requests: list[EngineRequest],
    tokens: list[int],
    blocks: list[int],
    sent: list[int],
    cuts: list[int],
    steps: int,
    block_size: int,
    caching: bool,
) -> DecodeRun:
    """The `DecodeRun` of a chain of jumps (`kvpool.manager.DecodeChain`'s run) of
    ``steps`` steps in all: each of ``requests`` as it was at the chain's start
    (``tokens``, ``blocks``, ``sent``: its counts then), with its slots up to step
    ``cuts[i]`` (the step it finished in, or the chain's last), if it has any, as
    `plan_jump` plans each jump's."""
    members = _Members(True)
    for i in range(len(requests)):
        members.add(requests[i], tokens[i], blocks[i], sent[i], cuts[i] + 1, block_size, caching)
    return members.run(steps)


class _Members:
    """The fields of a `DecodeRun` being built, member by member (`add`); without
    ``spell`` only counted (``told``, and `add`'s blocks), no field filled."""

    def __init__(self, spell: bool) -> None:
        self.spell = spell
        self.request_ids: list[str] = []
        self.new_tokens: list[Sequence[int]] = []
        self.targets: list[int] = []
        self.grows: list[int] = []
        self.fills: list[int] = []
        self.told = 0
        """The last member's ``num_sent`` once its slots are allocated."""

    def add(
        self,
        request: EngineRequest,
        tokens: i64,
        held: i64,
        since: i64,
        taken: i64,
        bs: i64,
        caching: bool,
    ) -> i64:
        """Add ``request``, with ``tokens`` tokens, ``held`` blocks and ``since`` heard,
        if it has a slot in the ``taken`` steps from now: its first growth and fill
        steps, and its generated tokens through its last slot as one span (``told``: how
        many it has heard then). Returns how many blocks its table grows by (one a
        growth), or -1 without a slot."""
        grow: i64 = held * bs - tokens + 1
        if grow >= taken:
            grow = -1
        fill: i64 = -tokens % bs if caching else -1
        if fill >= taken:
            fill = -1
        if grow < 0 and fill < 0:
            return -1
        last: i64 = -1  # its last slot's step
        blocks: i64 = 0
        if grow >= 0:
            blocks = (taken - 1 - grow) // bs + 1
            last = grow + (blocks - 1) * bs
        if fill >= 0:
            last_fill: i64 = fill + (taken - 1 - fill) // bs * bs
            if last_fill > last:
                last = last_fill
        first: i64 = grow if fill < 0 or 0 <= grow < fill else fill
        if tokens + first - request.prompt_length < since:  # told with its first slot
            raise RuntimeError(f"{request.request_id}: the manager heard of more tokens")
        told: i64 = tokens + last - request.prompt_length
        self.told = told
        if not self.spell:
            return blocks
        self.request_ids.append(request.request_id)
        self.new_tokens.append(
            segment_span(request.output_seed, request.output_length, since, told)
            if since < told
            else _NO_TOKENS
        )
        self.targets.append(tokens)
        self.grows.append(grow)
        self.fills.append(fill)
        return blocks

    def run(self, steps: int) -> DecodeRun:
        """The `DecodeRun` of the members added, of ``steps`` steps."""
        return DecodeRun(
            self.request_ids, self.new_tokens, self.targets, self.grows, self.fills, steps
        )
