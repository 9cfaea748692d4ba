"""The manager's public value types: an allocation's result, a prefill cost, counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import msgspec

from kvpool.events import KVEvent
from kvpool.manager.run_slots import gather, spell_out, split_chain
from kvpool.messages.values import PoolUsage
from kvpool.pool import BlockId
from kvpool.pool.runs import expand, expand_descents, runs_length


class Allocation(msgspec.Struct, frozen=True, gc=False):
    """What one successful `KvManager.allocate` did to the request's block table.

    ``block_runs`` holds the ids appended by this call, root first (a reused prefix
    first, then the fresh blocks), as runs of consecutive ids (`kvpool.pool.runs`: a
    prompt's few hundred blocks are a few runs); ``block_ids`` spells them out and
    ``num_blocks`` counts them. ``cached_blocks`` counts the reused prefix blocks among
    them (0 except on a request's first allocation). ``removed_runs`` holds the hashes
    whose last resident copy this call's reservation evicted, in eviction order, as
    descending runs (an extent is evicted last copy first: `kvpool.pool.runs
    .add_descent`); ``removed`` spells them out.
    """

    block_runs: list[int]
    cached_blocks: int
    removed_runs: list[int]

    @property
    def block_ids(self) -> list[BlockId]:
        """The ids appended, root first, as a fresh list."""
        return cast("list[BlockId]", expand(self.block_runs))

    @property
    def num_blocks(self) -> int:
        """How many blocks this call appended."""
        return runs_length(self.block_runs)

    @property
    def removed(self) -> list[int]:
        """The hashes evicted for good, in eviction order, as a fresh list."""
        return expand_descents(self.removed_runs)


class PrefillCost(msgspec.Struct, frozen=True, gc=False):
    """What admitting a request would cost now.

    ``cached_blocks``: leading full blocks the next allocation would reuse from the
    prefix cache; ``active_cached_blocks``: how many of those are in use by someone
    (they cost no free capacity); ``new_blocks``: fresh blocks still needed to hold every
    token the request has.
    """

    cached_blocks: int
    active_cached_blocks: int
    new_blocks: int


class AdmissionGate(msgspec.Struct, frozen=True, gc=False):
    """What a step lets its queued requests take: the inputs of vLLM 0.33's admission
    loop (``Scheduler.schedule``'s waiting queue, ``KVCacheManager.allocate_slots`` with
    ``full_sequence_must_fit``), which `KvManager.schedule` runs, checking each request
    with `kvpool.manager.admission.admit_blocks`; a scheduler that knows the queue
    head's cost checks it there itself first.

    ``budget``: tokens left in the step's budget (``max_num_batched_tokens`` less what
    is scheduled). ``headroom``: blocks the next admission may take from what is free or
    evictable (less what the step's running requests are about to take), before the
    watermark. ``watermark``: blocks held back while any request runs. ``running``:
    requests running before the next admission (vLLM's ``has_scheduled_reqs``: the
    watermark applies). ``seats``: how many more may run (``max_num_seqs`` less the
    running). ``chunked``: a prompt may be computed over several steps (chunked
    prefill), else it waits for a budget that holds it whole. ``full_sequence``: the
    fresh blocks of the request's whole sequence must fit (``scheduler_reserve_full_isl``),
    else those of this step's chunk.
    """

    budget: int
    headroom: int
    watermark: int = 0
    running: int = 0
    seats: int = 1
    chunked: bool = True
    full_sequence: bool = True


class QueuedRequest(msgspec.Struct, frozen=True, gc=False):
    """A waiting request a step may admit (`KvManager.schedule`): its id, and its prompt
    when the manager has not heard of it yet (it is registered when the step reaches it,
    as `KvManager.add_request` registers it)."""

    request_id: str
    prompt_token_ids: Sequence[int] | None = None


class ManagerStats(msgspec.Struct, frozen=True, gc=False):
    """Counters for a report, counted the way vLLM counts them.

    Prefix-cache queries and hits are in tokens and counted once per successful first
    allocation of a request (again after each preemption: a re-admission queries again);
    with prefix caching off nothing is counted, as vLLM reports no prefix-cache stats
    then. ``evictions`` is the pool's own count (`BlockPool.evictions`: copies evicted),
    read, not counted again. ``preemptions`` counts preempt calls that released blocks.
    ``kv_events`` counts the BlockStored and BlockRemoved events queued so far, and with
    KV cache events off the ones that would have been: what a router was (or would have
    been) told, whether or not anybody listens.
    """

    num_requests: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    preemptions: int
    kv_events: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over queried tokens; 0.0 before the first query."""
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


class StepUpdate(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """What one request's step leaves for the manager, applied in this order.

    ``append``: generated tokens to append; ``computed``: the new computed-token count to
    mark (-1: the watermark does not move); ``free``: the request finished.
    """

    request_id: str
    append: list[int]
    computed: int
    free: bool


class StepOutcome(msgspec.Struct, frozen=True, gc=False, tag=True):
    """After a step's updates (`KvManager.finish_step`): the events they and the step's
    allocations queued, drained, the pool's occupancy and counters after them, and the
    probed request's `PrefillCost` after them (None: no probe)."""

    events: list[KVEvent]
    usage: PoolUsage
    stats: ManagerStats
    cost: PrefillCost | None = None


class SlotRequest(msgspec.Struct, frozen=True, gc=False):
    """One request's part of a step's allocations (`KvManager.allocate_steps`): append
    ``new_tokens`` (those generated since the manager last heard), then grow the table
    to hold ``num_tokens`` and mark them computed."""

    request_id: str
    num_tokens: int
    new_tokens: Sequence[int] = []


class StepAllocations(msgspec.Struct, frozen=True, gc=False, tag=True):
    """A step's allocations (`KvManager.allocate_steps`): one `Allocation` per slot that
    fit, in order (fewer than the slots: the next one did not fit, and the rest were not
    tried), the events queued so far, drained, the counters after them, and the probed
    request's `PrefillCost` after them (None: no probe)."""

    allocations: list[Allocation]
    events: list[KVEvent]
    stats: ManagerStats
    cost: PrefillCost | None = None


class StepSchedule(msgspec.Struct, frozen=True, gc=False, tag=True):
    """What `KvManager.schedule` did: ``step`` as `KvManager.allocate_steps` gives one
    step (an `Allocation` per running slot that fit, in order, then one per admitted
    request; the events drained; the counters; and as ``cost`` the `PrefillCost` of the
    first queued request not admitted, asked after everything, when the step registered
    it or it was registered before; else None), ``costs``, each admitted request's
    cost as asked before its allocation, and ``run``, the result of the run or chain
    the call carried (None if none), made before the step."""

    step: StepAllocations
    costs: list[PrefillCost]
    run: RunAllocations | ChainAllocations | None = None


class DecodeStretch(msgspec.Struct, frozen=True, gc=False):
    """Consecutive steps' allocations in compact form, for `KvManager.allocate_stretch`:
    a run of decode steps in which tables grow and blocks fill, each request and its
    generated tokens named once, not once per step it takes part in.

    Slot ``k`` (in order) is ``SlotRequest(request_ids[members[k]], targets[k], t)``
    where ``t`` is the next ``appends[k]`` tokens of ``new_tokens[members[k]]``; step
    ``g`` holds the slots from ``step_ends[g - 1]`` (0 for ``g == 0``) up to
    ``step_ends[g]``. `steps` spells it out as the ``allocate_steps`` argument it
    stands for.
    """

    request_ids: list[str]
    new_tokens: list[Sequence[int]]
    members: list[int]
    targets: list[int]
    appends: list[int]
    step_ends: list[int]

    def steps(self) -> list[list[SlotRequest]]:
        """The steps of `SlotRequest` this stretch stands for (what `KvManager
        .allocate_steps` would take), in order."""
        used = [0] * len(self.request_ids)
        steps: list[list[SlotRequest]] = []
        start = 0
        for end in self.step_ends:
            slots = []
            for k in range(start, end):
                member = self.members[k]
                offset = used[member]
                used[member] = offset + self.appends[k]
                tokens = self.new_tokens[member][offset : offset + self.appends[k]]
                slots.append(SlotRequest(self.request_ids[member], self.targets[k], tokens))
            steps.append(slots)
            start = end
        return steps


class DecodeRun(msgspec.Struct, frozen=True, gc=False):
    """A run of decode steps' allocations in closed form, for `KvManager.allocate_run`:
    in each of ``steps`` steps every request named here computes one more token, so
    when its table grows and when its blocks fill is an arithmetic progression, not a
    slot each.

    Request ``i`` takes part in step ``s < steps`` (a *slot*) when ``s >= grows[i]``
    and ``s - grows[i]`` is a multiple of the block size (its table grows then), or
    likewise for ``fills[i]`` (with prefix caching, its target ends a block then): -1
    is no such step. In its slot at step ``s`` it targets ``targets[i] + s`` tokens and
    hears ``new_tokens[i]`` as they were generated: at its first slot all but one token
    a step from there to its last slot, then at each later slot one a step since its
    previous slot (the tokens reach the manager with the allocation that needs them, as
    the engine hands them over). `stretch` spells it out as the `DecodeStretch` it
    stands for; the steps with slots are its groups, in order.
    """

    request_ids: list[str]
    new_tokens: list[Sequence[int]]
    targets: list[int]
    grows: list[int]
    fills: list[int]
    steps: int

    def stretch(self, block_size: int) -> DecodeStretch:
        """The `DecodeStretch` this run stands for with blocks of ``block_size`` tokens:
        the same slots, step by step, in request order within a step."""
        members, targets, appends, step_ends = spell_out(
            self.grows,
            self.fills,
            self.targets,
            [len(tokens) for tokens in self.new_tokens],
            self.steps,
            block_size,
        )
        return DecodeStretch(
            list(self.request_ids), list(self.new_tokens), members, targets, appends, step_ends
        )


class RunAllocations(msgspec.Struct, frozen=True, gc=False, tag=True):
    """What `KvManager.allocate_run` did, in the closed form of its argument.

    ``allocations``: per request of the run, in order, one `Allocation` of the blocks
    its slots that fit appended (none cached; its ``removed_runs`` empty); ``slots``:
    how many slots fit, in the order of `DecodeRun.stretch` (fewer than all: the next
    one did not fit, and the rest were not tried); ``removed_runs``: the hashes evicted
    for good, in eviction order, as descending runs; ``kv_events``, ``events``,
    ``stats`` and ``cost``: per group tried, as `StretchAllocations` has them.
    """

    allocations: list[Allocation]
    slots: int
    removed_runs: list[int]
    kv_events: list[int]
    events: list[tuple[int, list[KVEvent]]]
    stats: ManagerStats
    cost: PrefillCost | None = None

    @classmethod
    def of_stretch(cls, stretch: DecodeStretch, result: StretchAllocations) -> RunAllocations:
        """``allocate_stretch``'s ``result`` of the ``stretch`` a run stands for
        (`DecodeRun.stretch`), in the run's form: each request's allocations joined into
        one, the removed hashes into one list."""
        joined, removed = gather(len(stretch.request_ids), stretch.members, result.allocations)
        return cls(
            [Allocation(blocks, 0, []) for blocks in joined],
            len(result.allocations),
            removed,
            result.kv_events,
            result.events,
            result.stats,
            result.cost,
        )


class DecodeChain(msgspec.Struct, frozen=True, gc=False):
    """Decode steps in which requests leave, for `KvManager.finish_chain`: ``run``'s
    slots (`DecodeRun`), and after step ``leaves[j]`` the requests ``frees[j]`` freed, in
    order. A request freed after step ``s`` takes part in no step after it (its slots
    are those of ``run`` up to ``s``); a request freed may also not be in ``run`` at all.

    It stands for its `segments`, each a run's allocations then its frees
    (`KvManager.finish_run`): the steps up to the first leave, those after it up to
    the next, and so on, then the steps after the last leave (with no frees) if any.
    The engine sends one for a fast-forward jump that goes on past the steps in which
    requests finish, when nobody waits for their blocks.
    """

    run: DecodeRun
    leaves: list[int]
    frees: list[list[str]]

    def segments(self, block_size: int) -> list[tuple[DecodeRun | None, list[StepUpdate]]]:
        """Each segment's run (None: no request has a slot in it) and frees, in order;
        each run's requests in ``run``'s order, its steps and targets counted from the
        segment's first step, and each request's new tokens those it hears in the
        segment."""
        return [
            (
                None if piece is None else DecodeRun(*piece),
                [StepUpdate(request_id, [], -1, True) for request_id in frees],
            )
            for piece, frees in split_chain(
                self.run.request_ids,
                self.run.new_tokens,
                self.run.targets,
                self.run.grows,
                self.run.fills,
                self.run.steps,
                self.leaves,
                self.frees,
                block_size,
            )
        ]


class ChainAllocations(msgspec.Struct, frozen=True, gc=False, tag=True):
    """What `KvManager.finish_chain` did: ``run``, its run's allocations as
    `KvManager.allocate_run` gives them (per request, its segments' blocks joined; its
    groups those of every segment, in order; ``stats`` after the last group), and
    ``outcomes``, each leave's frees' `StepOutcome`, in order, ``groups[j]`` of the
    run's groups before the ``j``-th (fewer outcomes than leaves: a slot did not fit,
    and nothing after it was tried)."""

    run: RunAllocations
    outcomes: list[StepOutcome]
    groups: list[int]


class StretchAllocations(msgspec.Struct, frozen=True, gc=False, tag=True):
    """What `KvManager.allocate_stretch` did, in the compact form of its argument.

    ``allocations``: one `Allocation` per slot that fit, in order (fewer than the slots:
    the next one did not fit, and the rest were not tried); ``kv_events``: per step
    tried, the ``kv_events`` counter after it; ``events``: the events each step that
    queued some drained, as ``(step, events)`` pairs; ``stats``: the counters after the
    last step tried (no other counter moves during a stretch: its requests hold blocks,
    so none is a first allocation); ``cost``: the probed request's `PrefillCost` after
    it (None: no probe). `of_steps` gives the same from ``allocate_steps``' results.
    """

    allocations: list[Allocation]
    kv_events: list[int]
    events: list[tuple[int, list[KVEvent]]]
    stats: ManagerStats
    cost: PrefillCost | None = None

    @classmethod
    def of_steps(cls, results: Sequence[StepAllocations]) -> StretchAllocations:
        """``allocate_steps``' ``results`` (at least one) in this compact form."""
        return cls(
            [allocation for result in results for allocation in result.allocations],
            [result.stats.kv_events for result in results],
            [(step, result.events) for step, result in enumerate(results) if result.events],
            results[-1].stats,
            results[-1].cost,
        )


__all__ = [
    "AdmissionGate",
    "Allocation",
    "ChainAllocations",
    "DecodeChain",
    "DecodeRun",
    "DecodeStretch",
    "ManagerStats",
    "PoolUsage",
    "PrefillCost",
    "QueuedRequest",
    "RunAllocations",
    "SlotRequest",
    "StepAllocations",
    "StepOutcome",
    "StepSchedule",
    "StretchAllocations",
    "StepUpdate",
]
