"""A vLLM v1-style mock engine: a scheduler stepping requests through one KV cache.

Each `MockEngine.step` is one forward pass of the modelled GPU:

1. *Running requests first*, in order, each with as many tokens as it still has to
   compute (one while decoding), within the step's token budget
   (``max_num_batched_tokens``). A request whose new tokens need a block that does not
   fit preempts a victim - the newest running request (LIFO, vLLM's rule) or the oldest
   (FIFO) - until it fits or is itself the victim (then the next running request, if
   any, is tried: under LIFO there is none). A victim's blocks are released leaf first,
   its computed count drops to 0 and it goes back to the *front* of the waiting queue; a
   victim already scheduled this step (FIFO) is unscheduled and its tokens return to
   the budget, and the loop's index steps back one, so the running request after the
   one that preempted is still tried this step (vLLM's ``req_index -= 1``). Dynamo's
   mocker does not step back after preempting the front of the running list: it skips
   the next running request for that step, so FIFO runs under pressure may differ
   from its replay there; kvpool keeps vLLM's behaviour.
2. *Then waiting requests*, first come first served, while the budget lasts, fewer than
   ``max_num_seqs`` run, and no request was preempted this step. A request's first
   allocation reuses its cached prefix (always leaving its last token to compute); the
   rest of its prompt is computed in chunks (chunked prefill) or, with chunked prefill
   off, all in one step or not at all (the queue waits). Admission is vLLM 0.33's
   (``allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl)``): it waits
   while the fresh blocks of the request's whole sequence (prompt, and for a preempted
   request the output so far; with ``scheduler_reserve_full_isl`` off, of this step's
   chunk only) plus the inactive cached prefix it would pin, plus the watermark blocks
   while any request runs, exceed what is free or evictable; the first request that
   does not fit stops admission for this step. Dynamo's mocker also requires the whole
   prompt to fit.
3. *Execution*: the simulated clock advances by the timing model's step time; each
   scheduled request's computed count grows; a request that has computed all its tokens
   samples one, and finishes, releasing its blocks leaf first, after its last output
   token. A step's KV work is one call (`KvClient.schedule`): the running requests
   that need blocks (or fill one), in order, then, if they all fit, vLLM's waiting loop
   run by the manager over the queue's first requests (registered when the loop
   reaches them, their costs asked, the admission check made, their first
   allocations); a queue whose requests all get in is handed over in further calls,
   twice as many each time. A slot that does not fit stops the call: the step preempts
   and its other allocations go in later calls (`KvClient.allocate_steps`), and it
   admits nobody. The call also drains the events queued so far and reads the
   counters, and the engine counts the blocks it was given, so only a step that
   finished, preempted or aborted a request needs `KvClient.finish_step`: the frees,
   then the rest of the events and the usage. The step's events go out as one
   `KVEventBatch` to the sink, if any. The queue head's cost comes back with the call
   that last changed the cache (the schedule's, an allocation's probe, or
   `finish_step`'s), so `prefill_cost` needs a call of its own only after an abort. A
   request reaches the manager with the first step that asks about it, not when it
   queues: an arrival costs no call of its own. A jump that only allocates, taken by
   `EngineLoop` (``carry``), rides on the next step's call too: a jump to an arrival
   costs no call of its own either (`fast_forward`).

*Same-step visibility* (vLLM v1's ``KVCacheManager.allocate_slots``, which Dynamo's
mocker follows): when a request is scheduled, its full blocks through its computed plus
newly scheduled tokens become cache-visible at once (``allocate(..., cache=True)``),
with their BlockStored events in this step's batch, so a request scheduled later in the
same step already hits them: two identical prompts arriving together share all but the
last block in their first step. The corner cases, as vLLM 0.33 decides them:

- *Decode tokens not yet known*: vLLM caches through ``min(computed + new,
  num_tokens)``. Here a step only schedules tokens the request has (the one sampled
  last step included), so the cap never bites; a token sampled in this step is known
  only after it and is cached when a later step schedules its block full.
- *The last prompt token*: it is always computed (a hit reuses at most ``num_tokens - 1``
  tokens), but a prompt that ends on a block boundary has its last block cached when
  scheduled, like any full block; a duplicate then recomputes its last block and caches
  that copy as a duplicate of a visible hash (no second Stored).
- *A victim preempted in the step it was scheduled* (only the FIFO victim can be; a
  LIFO victim is never yet scheduled, as in vLLM's FCFS policy): its tokens go back to
  the budget and its blocks are released leaf first, but the blocks it made visible
  stay cached, idle in the LRU, as vLLM's freed blocks keep their hash: the preemption
  removes nothing, a later eviction may (the allocation that preempted it, even).
  An allocation that fails (the preempting request's, before it fits) caches nothing.
- *Chunked prefill off*: a prompt is scheduled whole, so all its full blocks are
  visible at once; *prefix caching off*: nothing is hashed, cached or published.

Generated tokens reach the manager lazily, before a call that needs them (an allocation,
a block filling, a preemption): a partial block has no hash, so the manager loses
nothing by waiting, and a decode step that neither grows the table nor fills a block
costs no call of its own. A run of decode steps with nobody arriving, finishing,
preempted or admitted changes nothing but the clock, the counts and the blocks that
fill or are added at block boundaries: `MockEngine.fast_forward` takes it in one jump,
those blocks in one call, with results identical to single steps.

A request that could never run - more blocks than the pool holds for its prompt plus its
output, or, with chunked prefill off, more tokens than one step's budget - is rejected
when submitted, and so is one longer than ``max_model_len`` (prompt plus output).
Everything here is deterministic: same requests, same run.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Final

import msgspec
from mypy_extensions import mypyc_attr

from kvpool.engine.admission import rejection_reason
from kvpool.engine.config import EngineConfig
from kvpool.engine.execution import (
    apply_groups,
    apply_jump,
    apply_step,
    samples_first,
)
from kvpool.engine.fast_forward import (
    DecodeJump,
    chain_run,
    decode_growth,
    decode_slot,
    plan_jump,
)
from kvpool.engine.kv_client import KvClient
from kvpool.engine.metrics import EngineStats, close_batch, read_counters
from kvpool.engine.request import EngineRequest
from kvpool.engine.scheduler import plan_slots, schedule_fitting
from kvpool.engine.timing import is_context_free, is_usage_free
from kvpool.engine.work import step_work
from kvpool.errors import DuplicateRequestError, InvalidArgumentError
from kvpool.events import EventSink, KVEvent, KVEventBatch
from kvpool.manager import (
    AdmissionGate,
    Allocation,
    ChainAllocations,
    DecodeChain,
    PoolUsage,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepSchedule,
    StepUpdate,
)
from kvpool.manager.admission import admit_blocks
from kvpool.pool.runs import runs_length
from kvpool.workloads import RequestSpec

_UNBOUNDED: Final = 1 << 62
"""A step count no jump reaches."""

_NO_COST: Final = PrefillCost(0, 0, 0)
"""The admission cost without prefix caching: nothing cached (the gate reads no more)."""


class RequestOutput(msgspec.Struct, frozen=True):
    """What one step did for one scheduled request, as vLLM's ``EngineCoreOutput`` says it.

    ``num_computed_tokens`` is the tokens computed for it in the step; ``new_token_ids``
    the token it sampled (none for a prefill chunk or a recomputation that did not reach
    its end); ``num_cached_tokens`` the prompt tokens its admission reused from the
    prefix cache, set only in the step that admitted it (None in the others);
    ``finish_reason`` is ``"length"`` in the step that sampled its last token (the mock
    engine has no stop token), None before.
    """

    request_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    num_cached_tokens: int | None
    finish_reason: str | None


class StepResult(msgspec.Struct, frozen=True):
    """One step: the clock after it, its duration, and what happened to which request.

    ``scheduled`` maps request ids to the tokens computed for them (in schedule order);
    ``preempted`` lists this step's victims in preemption order; ``finished`` the
    requests that produced their last token; ``outputs`` one `RequestOutput` per
    scheduled request, in schedule order (empty when the engine's ``step_outputs`` is
    off). (A msgspec Struct: one per step, cheap to build.)
    """

    clock: float
    duration_s: float
    scheduled: dict[str, int]
    preempted: list[str]
    finished: list[str]
    outputs: list[RequestOutput]


class _Chain:
    """A chain of jumps being taken (`MockEngine._take_chain`): its requests as they
    were at its start, its jumps and what it frees."""

    def __init__(self, requests: list[EngineRequest]) -> None:
        self.requests = requests
        self.tokens = [request.num_tokens for request in requests]
        self.blocks = [request.num_blocks for request in requests]
        self.sent = [request.num_sent for request in requests]
        self.cuts = [-1] * len(requests)
        """The step each request finished in (-1: it did not)."""
        self.plans: list[DecodeJump] = []
        self.bounds: list[int] = []
        """The active count each jump was planned from (no free counted)."""
        self.leaves: list[int] = []
        self.frees: list[list[str]] = []
        self.steps = 0

    def message(self, config: EngineConfig) -> DecodeChain:
        """The chain's allocations and frees for the manager."""
        last = self.steps - 1
        cuts = [last if cut < 0 else cut for cut in self.cuts]
        run = chain_run(
            self.requests,
            self.tokens,
            self.blocks,
            self.sent,
            cuts,
            self.steps,
            config.block_size,
            config.enable_prefix_caching,
        )
        return DecodeChain(run, self.leaves, self.frees)


# Compiled with mypyc (setup.py); tests and tools still subclass it or wrap its methods.
@mypyc_attr(allow_interpreted_subclasses=True)
class MockEngine:
    """One engine (one data-parallel rank): a scheduler, a simulated clock, a KV client.

    ``clock`` is simulated seconds; event batches are stamped ``epoch + clock *
    ts_scale``. The engine never sleeps: pacing against the wall clock is the caller's
    business (see `kvpool.engine.simulation`). A paced caller sets ``epoch`` to the wall
    time (``time.time()``) of simulated 0 and ``ts_scale`` to ``1 / speedup_ratio``, so
    ``ts`` is the wall-clock time the step ends; unpaced, ``ts`` is ``epoch`` plus
    simulated seconds, a timeline that runs ahead of the wall clock.
    """

    def __init__(
        self,
        kv: KvClient,
        config: EngineConfig,
        *,
        rank: int = 0,
        sink: EventSink | None = None,
        epoch: float = 0.0,
        step_outputs: bool = True,
    ) -> None:
        if sink is not None and not config.enable_kv_cache_events:
            raise InvalidArgumentError(
                "an event sink needs enable_kv_cache_events: with it off, no event is built"
            )
        if kv.block_size != config.block_size or kv.capacity != config.num_gpu_blocks:
            raise InvalidArgumentError(
                f"the KV client has {kv.capacity} blocks of {kv.block_size} tokens; the "
                f"config says {config.num_gpu_blocks} of {config.block_size}"
            )
        self.kv = kv
        self.config = config
        # `EngineConfig.watermark_blocks` read once: the config is frozen and never
        # replaced, and the property is interpreted code (two reads a step otherwise)
        self._watermark_blocks = config.watermark_blocks
        self.rank = rank
        self.sink = sink
        self.epoch = epoch
        # whether `execute_step` builds `StepResult.outputs` (one object per scheduled
        # request a step: a simulation that reads only the stats turns it off)
        self.step_outputs = step_outputs
        self.ts_scale = 1.0
        self.clock = 0.0
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()
        # fast-forward jumps taken and the steps they covered (`fast_forward`'s nonzero
        # returns and their sum): how a benchmark tells jumped steps from single ones
        self.jumps = 0
        self.jumped_steps = 0
        self.rejected_ids: list[str] = []
        self._ids: set[str] = set()  # the waiting and running requests' ids
        self._preempted: list[str] = []
        # this step's admissions: request id -> the prompt tokens it reused (its output's
        # ``num_cached_tokens``); reset by `schedule_step`
        self._admitted: dict[str, int] = {}
        # The pool's active blocks as of now, kept within a step from the allocations'
        # exact effect (fresh blocks, plus inactive cached blocks a first allocation
        # pins) and re-read after every step; -1 until the first step reads it. A
        # preemption makes it an overestimate (a step that preempted admits nobody, so
        # the admission check never reads it stale) until it is re-read after the
        # schedule, so the timing model sees the pool after the step's allocations.
        self._num_active = -1
        # Whether a KV call since the last `finish_step` changed the usage in a way the
        # engine does not count itself (a preemption or an abort frees blocks others may
        # share). Allocations (`KvClient.allocate_steps`) drain their events and read the
        # counters in the same call, and their blocks are counted here, so a step whose
        # only KV work is allocations, with nothing finished, needs no `finish_step`.
        self._dirty = True
        self._step_events: list[KVEvent] = []  # drained by this step's allocations
        # A jump taken with ``carry`` whose allocations ride on the next KV call (a
        # step's `KvClient.schedule`, or `settle` before any other): its plan and the
        # active blocks before it. Its requests, clock and active count moved with the
        # jump; its counters, batch counts and group samples move when it lands. Or a
        # chain of jumps (`_take_chain`), whose frees the active count leaves out until
        # it lands: an upper bound until then, which the schedule's gate is counted
        # from (the manager adds what the frees released) and nothing else reads.
        self._carried: tuple[DecodeJump, int] | _Chain | None = None
        # The queue head's cost as the last KV call that changed the cache answered it
        # (a probe), or None: a jump that watches the head needs no query of its own.
        self._head_cost: tuple[str, PrefillCost] | None = None
        # Prompts go to the manager as runs (`TokenRuns`): a manager with ``run_keys``
        # (KV events off: no hash leaves the process) names their blocks without a token
        # built; one with Dynamo's hashes hashes each run's blocks once (a memo by
        # chain), and gets the tokens built here when events (which carry them) are on.
        self._with_tokens = config.enable_kv_cache_events
        # Whether a jump asks the timing model for every step's duration, or once (and
        # again only when the usage changes, if it reads the usage):
        # `kvpool.engine.timing.is_context_free`, `is_usage_free`.
        self._decode_time_varies = not is_context_free(config.timing)
        self._decode_usage_matters = not is_usage_free(config.timing)

    def __repr__(self) -> str:
        return (
            f"MockEngine(rank={self.rank}, clock={self.clock:.3f}, "
            f"running={len(self.running)}, waiting={len(self.waiting)})"
        )

    # ---------------------------------------------------------------- intake

    @property
    def has_work(self) -> bool:
        """True while a request is waiting or running."""
        return bool(self.running or self.waiting)

    @property
    def num_outstanding(self) -> int:
        """Requests admitted and not finished (waiting plus running)."""
        return len(self.running) + len(self.waiting)

    @property
    def num_active_blocks(self) -> int:
        """The engine's running count of the pool's active blocks (-1 before any step).

        The admission check reads it instead of asking the pool: it is re-read from the
        pool after every step and kept exact within a step from each allocation's effect.
        While a chain of jumps is carried (`fast_forward`'s ``carry``) it counts the
        blocks of the requests the chain frees until the next KV call: `settle_usage`
        makes it exact first.
        """
        return self._num_active

    async def settle_usage(self) -> None:
        """`settle` a carried chain of jumps, if one waits, so that `num_active_blocks`
        is exact (a carried jump leaves it exact: it has no free)."""
        if isinstance(self._carried, _Chain):
            await self.settle()

    def advance_to(self, when: float) -> None:
        """Move an idle engine's clock forward to ``when`` (a busy clock only moves by steps)."""
        if not self.has_work and when > self.clock:
            self.clock = when

    def rejection_reason(self, spec: RequestSpec) -> str | None:
        """Why ``spec`` could never run on this engine, or None if it can
        (`kvpool.engine.admission.rejection_reason` of its config)."""
        return rejection_reason(self.config, spec)

    async def submit(self, spec: RequestSpec, arrival_s: float | None = None) -> bool:
        """Queue a request; False if it was rejected.

        ``arrival_s`` (default: now, ``clock``) is when it arrived, for its latencies: a
        request may arrive while a step is running, before the clock that step reached.
        A rejected request is counted and never reaches the KV manager; an accepted one
        reaches it with its first admission (`_admit`). Raises `DuplicateRequestError`
        for the id of a request waiting or running, changing nothing.
        """
        stats = self.stats
        arrived = self.clock if arrival_s is None else min(arrival_s, self.clock)
        if spec.request_id in self._ids:
            raise DuplicateRequestError(f"request {spec.request_id!r} is already queued or running")
        if self.rejection_reason(spec) is not None:
            stats.submitted += 1
            stats.rejected += 1
            self.rejected_ids.append(spec.request_id)
            stats.requests.append(EngineRequest(spec, arrived).record(self.rank, rejected=True))
            return False
        stats.submitted += 1
        self._ids.add(spec.request_id)
        self.waiting.append(EngineRequest(spec, arrived))
        return True

    async def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request between steps and free its blocks leaf first.

        Its blocks go back as a completion's do (cached ones to the LRU, leaf before
        parent; nothing is evicted, so no event), its counters are dropped from the
        running and waiting counts and ``stats.aborted`` grows. Returns False, changing
        nothing, if the request is neither waiting nor running (finished, rejected or
        unknown). Raises what the KV client raises. Call it only between steps.
        """
        for queue in (self.running, self.waiting):
            for index, request in enumerate(queue):
                if request.request_id == request_id:
                    del queue[index]
                    self._ids.discard(request_id)
                    if not request.registered:  # the manager never heard of it
                        self.stats.aborted += 1
                        return True
                    self._dirty = True
                    self._head_cost = None
                    await self.settle()
                    await self.kv.free(request_id)
                    self.stats.aborted += 1
                    if self._num_active >= 0:  # keep the admission check's count exact
                        self._num_active = (await self.kv.usage()).num_active
                    return True
        return False

    # ------------------------------------------------------------------ steps

    async def step(self) -> StepResult:
        """Schedule and execute one step; return what it did.

        Raises `RuntimeError` when there is nothing to do (see `has_work`) or when the
        scheduler cannot make progress (a bug: rejection keeps that from happening).
        """
        return await self.execute_step(await self.schedule_step())

    async def schedule_step(self) -> dict[EngineRequest, int]:
        """The first half of `step`: schedule (allocating and preempting) and return the
        step's requests and token counts, for `step_duration` and `execute_step`.

        Data-parallel ranks in lockstep schedule each, then execute with the longest
        duration: nothing may happen to the engine between the two halves.
        """
        if not self.has_work:
            raise RuntimeError("step() of an idle engine")
        self._preempted = []
        self._admitted = {}
        self._step_events = []
        if self._num_active < 0:
            await self.settle()
            self._num_active = (await self.kv.usage()).num_active
        scheduled = await self._schedule()
        if self._carried is not None:  # landed before the step executes
            await self.settle()
        if not scheduled:
            raise RuntimeError(f"the scheduler made no progress: {self!r}")
        if self._preempted:  # the running count overestimates after a preemption
            self._num_active = (await self.kv.usage()).num_active
        return scheduled

    def step_duration(self, scheduled: dict[EngineRequest, int]) -> float:
        """The timing model's duration of the step `schedule_step` returned."""
        config = self.config
        work = step_work(scheduled, self._num_active, config.num_gpu_blocks, config.block_size)
        return config.timing.duration(work)

    async def execute_step(
        self, scheduled: dict[EngineRequest, int], duration_s: float | None = None
    ) -> StepResult:
        """The second half of `step`: run the step `schedule_step` returned for
        ``duration_s`` (default: its own `step_duration`; a lockstep rank waits for the
        slowest, so it passes that one's) and return what it did."""
        if not self.step_outputs:
            duration, finished = await self._execute(scheduled, duration_s)
            return StepResult(
                clock=self.clock,
                duration_s=duration,
                scheduled={request.request_id: n for request, n in scheduled.items()},
                preempted=self._preempted,
                finished=finished,
                outputs=[],
            )
        sampled_before = [request.num_output for request in scheduled]
        duration, finished = await self._execute(scheduled, duration_s)
        admitted = self._admitted
        outputs = []
        for (request, num_new), before in zip(scheduled.items(), sampled_before, strict=True):
            request_id = request.request_id
            # at most one token a step: the one a request that computed all its tokens samples
            sampled = request.num_output != before
            outputs.append(
                RequestOutput(
                    request_id,
                    num_new,
                    [request.spec.output.token(before)] if sampled else [],
                    admitted.get(request_id),
                    "length" if request.finish_s is not None else None,
                )
            )
        return StepResult(
            clock=self.clock,
            duration_s=duration,
            scheduled={request.request_id: n for request, n in scheduled.items()},
            preempted=self._preempted,
            finished=finished,
            outputs=outputs,
        )

    async def fast_forward(
        self,
        until: float = math.inf,
        *,
        cross_boundaries: bool = True,
        carry: bool = False,
        chain: bool = False,
    ) -> int:
        """Take at once the decode steps that start before ``until``; return how many
        (0: the next step is not one, or does not start before ``until``: `step`).

        Such a step has every running request decode one token, and none leaves: none
        samples its last token, every running request fits the token budget, the
        waiting queue admits nobody, and every table that grows gets its block (a
        growth that would not fit preempts: the jump stops before it). With nobody
        waiting and ``cross_boundaries``, the jump may also end with the step in which
        requests sample their last token: they finish then, as `step` finishes them
        (records, stats, their frees, the step's batch and its usage sample), and the
        frees ride on the jump's allocations (`KvClient.finish_run`: one call for
        both); a finishing step changes no admission when nobody waits, so only the
        jump's end moves. A queue head the manager has not heard of (with prefix caching)
        stops it before it starts: only the step's admission call asks the head's cost,
        admitting it if it may (`_admit`: one call, whether it is admitted or not). What
        else it may do depends on the queue's head:

        - *Nobody can be admitted whatever the cache holds* (the queue is empty, the
          head is held back by ``max_num_seqs`` or the token budget, or prefix caching
          is off, so the jump's growth only makes the head's need harder to meet) and
          ``cross_boundaries`` (the default): the jump crosses block boundaries. The
          tables that grow and the blocks that fill (turning visible) in its steps go
          to the manager in one `KvClient.allocate_run` call (a `DecodeRun`: each
          request, its generated tokens and its step count named once);
          each step's events are published as a batch of its own, stamped with that
          step's end, and each step's duration reads the KV usage after its growth.
        - Otherwise (the head's admission depends on what the cache holds, or
          ``cross_boundaries=False``, which a paced run passes so that no batch goes
          out before its time): the jump also stops before a step in which a table
          grows or a block fills. Its steps change no block and need no KV call, and
          the head's admission, asked once, keeps its answer throughout.

        The jump computes its steps in closed form: each step's duration from the
        timing model (asked again only when the context or the usage can change it),
        the clock and the busy time added step by step (so they are bit for bit those
        of single steps), one inter-token gap per step counted for all running
        requests, and each request's counts moved (its tokens reach the manager with
        the allocation that needs them, as after single steps). Stats, samples, records
        and event batches come out exactly as `step` would make them.

        With ``carry``, a jump that makes a KV call only to allocate (it finishes nobody
        and watches no head) and publishes nowhere (no sink) leaves that call to ride on
        the engine's next one: the next step's `KvClient.schedule` carries it (a jump to
        an arrival then costs no call of its own), and any other KV call the engine
        makes sends it first (`settle`). Until then the manager has not heard of it and
        the stats lack its counters, batch counts and usage samples after its first
        step; everything the engine itself keeps (its requests, clock, active blocks)
        has moved. `EngineLoop` passes it, and settles its engines when it stops.

        With ``chain`` (the caller's promise that no request arrives before ``until``
        whoever finishes: `EngineLoop` passes it for a source that is not reactive), a
        finishing jump goes on past its finishing step as the next call would, jump
        after jump, while nobody waits and until a jump finishes nobody: `_take_chain`.
        With ``carry`` too (and prefix caching), the chain's call rides on the next
        step's schedule as a jump's does (a `ScheduleAfterChain`): a chain to an
        arrival costs no call of its own either. Until it lands the active count
        includes the blocks of the requests it freed (the manager says which a free
        releases), so the schedule's gate is counted from that bound and the manager
        adds what the frees released; anything else that reads the count settles the
        chain first (`settle_usage`).
        """
        running = self.running
        clock = self.clock
        if not running or self._num_active < 0 or not clock < until:
            return 0
        config = self.config
        bs = config.block_size
        caching = config.enable_prefix_caching
        n = len(running)
        budget = config.max_num_batched_tokens - n
        if budget < 0:
            return 0  # not every running request is scheduled
        waiting = self.waiting
        admits = waiting and budget > 0 and n < config.max_num_seqs
        if admits and caching and not waiting[0].registered:
            return 0  # a step asks the head's cost, and admits it if it may, in one call
        if isinstance(self._carried, _Chain):
            await self.settle()  # what follows reads the active count: the frees' too
        if cross_boundaries:
            # With nobody waiting, a request's last token ends the jump, not the step
            # before it: finishing changes no admission, and the free is the one call
            # the finishing step would make after its allocations (`_finish_jump`).
            finishing = not waiting
            head: EngineRequest | None = None
            cost: PrefillCost | None = None
            if admits:
                # Planned only once the first step is known to be one the jump may take:
                # a plan the head's admission then refuses would be thrown away whole.
                # (With nobody to admit, the plan finds that out itself: it takes no
                # step then.)
                growing = decode_growth(running, bs, finishing)
                if growing < 0 or self._num_active + growing > config.num_gpu_blocks:
                    return 0
                # The head's admission is asked after the step's allocations: with the
                # blocks the next step's growth takes, and (prefix caching) at a cost
                # the jump watches, stopping at the step that changes it.
                head = waiting[0]
                cost = await self._cost_now(head)
                if self._admission(head, budget, cost, growing) is not None:
                    return 0  # the next step admits the head of the queue
            plan = self._plan_jump(until, _UNBOUNDED, cross_boundaries=True, finishing=finishing)
            if not plan.taken:
                return 0
            if plan.finished and chain and self.sink is None and not self._decode_usage_matters:
                return self._jumped(await self._take_chain(plan, until, carry and caching))
            return self._jumped(await self._take_jump(plan, until, head, cost, carry))
        plan = self._plan_jump(until, _UNBOUNDED, cross_boundaries=False)
        if not plan.taken:
            return 0
        if admits:
            head = waiting[0]
            if self._admission(head, budget, await self._cost_now(head)) is not None:
                return 0  # the next step admits the head of the queue
        return self._jumped(await self._take_jump(plan, until, None, None, carry))

    def _jumped(self, steps: int) -> int:
        """Count a jump of ``steps`` steps; return ``steps``."""
        self.jumps += 1
        self.jumped_steps += steps
        return steps

    async def _take_jump(
        self,
        plan: DecodeJump,
        until: float,
        head: EngineRequest | None,
        cost: PrefillCost | None,
        carry: bool = False,
    ) -> int:
        """Take the jump `fast_forward` planned: the ``plan``'s allocations (if it crosses
        block boundaries) in one `KvClient.allocate_run` call, then the jump applied.
        With a ``head`` waiting for blocks (its admission refused at ``cost``, None
        without prefix caching) the call stops after the first step that changes its
        cost (only prefix caching can), and that step is finished as `step` would finish
        it, admissions included. With ``carry`` (`fast_forward`'s), a jump that only
        allocates leaves its call to the next one."""
        config = self.config
        running = self.running
        probe = None if cost is None or head is None else head.request_id
        run = plan.run
        groups = len(plan.step_ends)
        result = None
        finish: StepOutcome | None = None
        tried = groups
        if self._carried is not None:
            await self.settle()
        if run is not None:
            if carry and probe is None and not plan.finished and self.sink is None:
                self._carried = (plan, self._num_active)
                self._remember_cost(None, None)  # the cache changes with the run
                self._apply_plan(plan)
                return plan.taken
            if plan.finished:  # with the frees in the same call (no probe: nobody waits)
                result, finish = await self.kv.finish_run(run, self._frees(plan))
            else:
                result = await self.kv.allocate_run(run, probe, stop_if_cost_changes=cost)
            tried = self._check_run(plan, result, self._num_active)
            self._remember_cost(probe, result.cost)
        # The call stops after the first group that changed the head's cost; that group
        # may be the plan's last, so a full count of groups does not mean no change.
        changed = probe is not None and result is not None and result.cost != cost
        if tried == groups and not changed:
            held = self._apply_jump(plan, result)
            if plan.finished:
                await self._finish_jump(plan, held, finish)
            return plan.taken
        if plan.finished:  # a finishing jump has no probe, so it never stops short
            raise RuntimeError(f"a finishing jump's allocations stopped short: {self!r}")
        # The head's cost changed in group `last`: the steps before it are a jump, and
        # `last` (its allocations made) may admit, as `step` would.
        last = tried - 1
        if probe is None or result is None or last < 0:
            raise RuntimeError(f"a jump's allocations stopped short: {self!r}")
        before = self._plan_jump(until, plan.group_steps[last], cross_boundaries=True)
        if before.taken != plan.group_steps[last] or len(before.step_ends) != last:
            raise RuntimeError(f"a jump planned twice planned two jumps: {self!r}")
        if before.taken:
            self._apply_jump(before, result)
        # Group ``last`` is this step's slots: their tokens heard, their growths made.
        bs = config.block_size
        caching = config.enable_prefix_caching
        growing: list[EngineRequest] = []
        for request in running:
            slot = decode_slot(request, 0, bs, caching)
            if slot:
                request.num_sent = request.num_tokens - request.prompt_length
                if slot == 2:
                    growing.append(request)
        self._preempted = []
        self._step_events = [
            event for group, events in result.events if group == last for event in events
        ]
        scheduled = dict.fromkeys(running, 1)
        for request in growing:
            self._grant_blocks(request, 1)
        read_counters(self.stats, result.stats)
        await self._admit(scheduled, config.max_num_batched_tokens - len(running))
        await self._execute(scheduled)
        return before.taken + 1

    async def _take_chain(self, plan: DecodeJump, until: float, carry: bool) -> int:
        """Take the finishing jump ``plan`` and the jumps that follow it while each one
        finishes requests (nobody waits, and `fast_forward`'s ``chain`` says nobody
        arrives before ``until``), and the one after the last if it takes a step, as
        `fast_forward` would take them one call at a time, but in one KV call: their
        allocations and frees as one `DecodeChain` (`KvClient.finish_chain`). Returns
        the steps taken.

        Each jump is planned once the one before it is applied (requests moved and
        finished, clock and stats on), from an active count that leaves out the frees
        so far: the manager says how many blocks a free releases (a request's prefix
        may be shared), so until it answers the count is an upper bound, and a growth
        that fits under it fits. A jump that the bound cuts short ends the chain, and
        the next call goes on with the true count. Usage samples, counters and batches
        wait for the answer (nothing records one in between) and are then recorded in
        the order single jumps record them, with the true counts: the timing model
        does not read the usage (the caller checks), so no duration depends on them.
        With ``carry`` the call is left to ride on the next one (`fast_forward`)."""
        if self._carried is not None:
            await self.settle()
        chain = _Chain(self.running)
        self._plan_chain(chain, plan, until)
        self._remember_cost(None, None)  # the cache changes with the chain
        self._carried = chain
        if not carry:
            await self.settle()
        return chain.steps

    def _plan_chain(self, chain: _Chain, plan: DecodeJump, until: float) -> None:
        """`_take_chain`'s jumps from ``plan`` on, each applied once planned (its usage
        samples left out); the requests that finish leave the running list."""
        capacity = self.config.num_gpu_blocks
        stats = self.stats
        cuts = chain.cuts
        where = list(range(len(self.running)))  # each running request's index in the chain
        while True:
            chain.plans.append(plan)
            chain.bounds.append(self._num_active)
            running = self.running
            apply_jump(plan, running, stats, self._num_active, capacity, self.rank, False)
            self.clock = plan.clock
            self._num_active = plan.active
            chain.steps += plan.taken
            if not plan.finished:
                return
            freed: list[str] = []
            for index in plan.finished:
                request_id = running[index].request_id
                freed.append(request_id)
                self._ids.discard(request_id)
                cuts[where[index]] = chain.steps - 1
            chain.leaves.append(chain.steps - 1)
            chain.frees.append(freed)
            kept = [k for k in range(len(running)) if running[k].finish_s is None]
            self.running = [running[k] for k in kept]
            where = [where[k] for k in kept]
            if not kept:
                return
            plan = self._plan_jump(
                until, _UNBOUNDED, cross_boundaries=True, finishing=True, spell=False
            )
            if not plan.taken:
                return

    def _apply_chain(self, chain: _Chain, result: ChainAllocations) -> None:
        """Record what `_take_chain`'s jumps left out once the manager answered
        (``result``, checked): each jump's samples, groups and free, in order, with the
        true active counts."""
        capacity = self.config.num_gpu_blocks
        stats = self.stats
        plans = chain.plans
        bounds = chain.bounds
        outcomes = result.outcomes
        # Its samples, recorded at once at the end: a chain admits nobody, so the prefix
        # counters every sample carries are those before it (checked).
        queries = stats.prefix_query_tokens
        hits = stats.prefix_hit_tokens
        samples: tuple[list[float], list[float]] = ([], [])
        times, usages = samples
        first = 0  # the chain's first group of each jump
        active = bounds[0]  # the true count before each jump
        for j in range(len(plans)):
            plan = plans[j]
            shift = bounds[j] - active
            if samples_first(plan):
                times.append(plan.first_end)
                usages.append(active / capacity)
            held = self._apply_groups(plan, result.run, first, shift, samples)
            first += len(plan.step_ends)
            if plan.finished:
                outcome = outcomes[j]
                self._read_outcome(None, outcome)
                events = held + outcome.events if held else outcome.events
                self._end_step(events, plan.clock, samples)
                active = outcome.usage.num_active
            else:
                active = plan.active - shift
        if stats.prefix_query_tokens != queries or stats.prefix_hit_tokens != hits:
            raise RuntimeError(f"a chain of jumps moved the prefix counters: {self!r}")
        stats.record_samples(times, usages, queries, hits)
        self._num_active = active

    def _check_chain(self, chain: _Chain, result: ChainAllocations) -> None:
        """Check a chain's ``result`` against its jumps' plans (`_take_chain`): every
        slot fit, every free was made, and the blocks given are the jumps' growth."""
        plans = chain.plans
        bounds = chain.bounds
        slots = 0
        for plan in plans:
            if plan.step_ends:
                slots += plan.step_ends[-1]
        grown = 0
        for allocation in result.run.allocations:
            grown += runs_length(allocation.block_runs)
        leaves = len(plans) if plans[-1].finished else len(plans) - 1
        if (
            result.run.slots != slots
            or len(result.outcomes) != leaves
            or grown != plans[-1].active - bounds[0]
        ):
            raise RuntimeError(f"a chain of jumps' allocations did not fit: {self!r}")

    def _plan_jump(
        self,
        until: float,
        max_steps: int,
        *,
        cross_boundaries: bool,
        finishing: bool = False,
        spell: bool = True,
    ) -> DecodeJump:
        """The jump from now (`kvpool.engine.fast_forward.plan_jump`); nothing changes."""
        config = self.config
        return plan_jump(
            self.running,
            config.block_size,
            config.enable_prefix_caching,
            self.clock,
            until,
            self._num_active,
            config.num_gpu_blocks,
            config.timing,
            self._decode_time_varies,
            self._decode_usage_matters,
            self.stats.busy_s,
            max_steps,
            cross_boundaries,
            finishing,
            spell,
        )

    def _check_run(self, plan: DecodeJump, result: RunAllocations, before: int) -> int:
        """How many of ``plan``'s groups its allocations' ``result`` tried, once checked
        against the plan: each group tried fit, and the blocks given are the plan's
        growth from ``before`` active blocks."""
        tried = len(result.kv_events)
        if not tried or result.slots != plan.step_ends[tried - 1]:
            raise RuntimeError(f"a decode step's allocations did not fit: {self!r}")
        grown = 0
        for allocation in result.allocations:
            grown += runs_length(allocation.block_runs)
        if grown != plan.group_active[tried - 1] - before:
            raise RuntimeError(
                f"planned {plan.group_active[tried - 1]} active blocks, "
                f"the pool has {before + grown}: {self!r}"
            )
        return tried

    async def settle(self) -> None:
        """Send a carried jump's allocations on their own (`fast_forward`'s ``carry``),
        if one waits: after it, the manager and the stats hold all the engine did.
        Every KV call but a step's schedule (which carries them) makes it first; the
        hot paths (a step's end, a jump, an allocation) test ``_carried`` before they
        await it, since awaiting even a coroutine that does nothing builds one."""
        carried = self._carried
        if isinstance(carried, _Chain):
            self._carried = None  # sent once: see `_land_chain`
            self._land_chain(carried, await self.kv.finish_chain(carried.message(self.config)))
        elif carried is not None:
            run = carried[0].run
            assert run is not None  # only a jump with allocations is carried
            self._land(await self.kv.allocate_run(run))

    def _land_chain(self, chain: _Chain, result: RunAllocations | ChainAllocations | None) -> None:
        """A carried chain's result came back (from the call that carried it): checked
        and applied (`_apply_chain`). The caller took the chain out of ``_carried``
        before making that call: a call carrying a chain is a give-back, made even if
        the caller leaves (`ScheduleAfterChain`), so its frees are never sent twice."""
        if type(result) is not ChainAllocations:
            raise RuntimeError(f"a carried chain came back without its result: {self!r}")
        self._check_chain(chain, result)
        self._apply_chain(chain, result)

    def _land(self, result: RunAllocations | ChainAllocations | None) -> None:
        """A carried jump's allocations came back (``result``, from the call that
        carried them): check them against the plan and apply what they return
        (`apply_groups`)."""
        carried = self._carried
        if carried is None:
            return
        assert not isinstance(carried, _Chain)  # a chain lands by `_land_chain`
        plan, before = carried
        if type(result) is not RunAllocations:
            raise RuntimeError(f"a carried jump came back without its allocations: {self!r}")
        if self._check_run(plan, result, before) != len(plan.step_ends):
            raise RuntimeError(f"a carried jump's allocations stopped short: {self!r}")
        self._carried = None
        self._apply_groups(plan, result)

    def _apply_jump(self, plan: DecodeJump, result: RunAllocations | None) -> list[KVEvent]:
        """Apply a jump whose allocations returned ``result``: `_apply_plan`, then
        `_apply_groups`."""
        self._apply_plan(plan)
        return self._apply_groups(plan, result)

    def _apply_plan(self, plan: DecodeJump) -> None:
        """Move the requests, the stats, the clock and the active count by the jump
        ``plan`` (`apply_jump`)."""
        apply_jump(
            plan, self.running, self.stats, self._num_active, self.config.num_gpu_blocks, self.rank
        )
        self.clock = plan.clock
        self._num_active = plan.active

    def _apply_groups(
        self,
        plan: DecodeJump,
        result: RunAllocations | None,
        first: int = 0,
        shift: int = 0,
        samples: tuple[list[float], list[float]] | None = None,
    ) -> list[KVEvent]:
        """Apply what the jump ``plan``'s allocations returned (`apply_groups`, the plan's
        groups from ``first`` on, its active counts ``shift`` too high, its samples
        gathered in ``samples`` if given) and publish each step's batch, stamped with that
        step's end; return a finishing jump's last step's events, which `_finish_jump`
        batches."""
        batches, held = apply_groups(
            plan, result, self.stats, self.config.num_gpu_blocks, first, shift, samples
        )
        sink = self.sink
        if sink is not None:
            for end, events in batches:
                sink.publish(
                    KVEventBatch(
                        ts=self.epoch + end * self.ts_scale,
                        events=events,
                        data_parallel_rank=self.rank,
                    )
                )
        return held

    def _frees(self, plan: DecodeJump) -> list[StepUpdate]:
        """The manager's updates of a finishing jump: its finished requests' frees, in
        running order (as `apply_step` makes them)."""
        running = self.running
        return [StepUpdate(running[index].request_id, [], -1, True) for index in plan.finished]

    async def _finish_jump(
        self, plan: DecodeJump, held: list[KVEvent], outcome: StepOutcome | None
    ) -> None:
        """End a finishing jump's last step as `_execute` ends a step that finished
        requests: free them (the ``outcome`` of the jump's `KvClient.finish_run`,
        or one `KvClient.finish_step` for a jump that allocated nothing; no probe:
        nobody waits), then the step's batch (``held``, its allocations' events, then
        the free's) and its usage sample."""
        if outcome is None:
            outcome = await self.kv.finish_step(self._frees(plan), None)
        running = self.running
        for index in plan.finished:
            self._ids.discard(running[index].request_id)
        self.running = [request for request in running if request.finish_s is None]
        self._read_outcome(None, outcome)
        self._end_step(held + outcome.events if held else outcome.events, self.clock)

    def _read_outcome(self, probe: str | None, outcome: StepOutcome) -> None:
        """Take in a `KvClient.finish_step` outcome: the probed head's cost, the usage
        and the counters."""
        self._remember_cost(probe, outcome.cost)
        self._dirty = False
        self._num_active = outcome.usage.num_active
        read_counters(self.stats, outcome.stats)

    def _end_step(
        self,
        events: list[KVEvent],
        now: float,
        samples: tuple[list[float], list[float]] | None = None,
    ) -> None:
        """A step's end at ``now``: its batch of ``events`` to the sink, if the step told
        a router something, and its usage sample (gathered in ``samples`` if given, for
        the caller to record)."""
        stats = self.stats
        if close_batch(stats) and events and self.sink is not None:
            self.sink.publish(
                KVEventBatch(
                    ts=self.epoch + now * self.ts_scale,
                    events=events,
                    data_parallel_rank=self.rank,
                )
            )
        usage = self._num_active / self.config.num_gpu_blocks
        if samples is not None:
            samples[0].append(now)
            samples[1].append(usage)
            return
        stats.record_sample(now, usage, stats.prefix_query_tokens, stats.prefix_hit_tokens)

    async def run_until_idle(self) -> None:
        """Step until every submitted request has finished."""
        while self.has_work:
            await self.step()

    async def final_usage(self) -> PoolUsage:
        """Check the pool's invariants and return its occupancy (0 active when idle)."""
        await self.settle()
        await self.kv.check_invariants()
        return await self.kv.usage()

    async def _schedule(self) -> dict[EngineRequest, int]:
        """Pick this step's requests and token counts, allocating and preempting."""
        config = self.config
        bs = config.block_size
        lifo = config.preemption_mode == "lifo"
        budget = config.max_num_batched_tokens
        scheduled: dict[EngineRequest, int] = {}
        running = self.running
        preempted = False

        caching = config.enable_prefix_caching
        waiting = self.waiting
        # the queue's head, whose admission cost the allocation asks for in the same call
        probe: str | None = None
        i = 0
        while True:
            i, budget = schedule_fitting(running, i, budget, scheduled, bs, caching)
            if i >= len(running) or budget <= 0:
                break
            # running[i] and the later requests that need a KV call (a table must grow, or
            # a block fills and turns cache-visible now, at schedule time, as in vLLM: see
            # the module docstring) are allocated in one call, in order, while they fit;
            # the tokens generated since the manager last heard ride on each allocation
            plan, left = plan_slots(running, i, budget, bs, caching)
            told = [running[index].num_sent for index, _ in plan]
            slots = []
            for index, target in plan:
                request = running[index]
                pending: Sequence[int] = request.take_pending() if request.has_pending else []
                slots.append(SlotRequest(request.request_id, target, pending))
            # If every slot fits, this call is the step's last (`plan_slots`): its
            # admissions ride on it, and the step's KV work is one call.
            queue = [] if preempted else self._queue(left, plan, 1)
            if queue:
                schedule = await self._schedule_call(slots, queue, left)
                allocations = schedule.step.allocations[: len(slots)]
            else:
                if (
                    caching
                    and waiting
                    and waiting[0].registered
                    and len(running) < config.max_num_seqs
                ):
                    probe = waiting[0].request_id
                allocations = (await self._allocate(slots, probe)).allocations
            for (index, target), allocation in zip(plan, allocations, strict=False):
                # the requests between two allocations need no call
                i, budget = schedule_fitting(running, i, budget, scheduled, bs, caching)
                request = running[i]
                if i != index:
                    raise RuntimeError(f"{request.request_id}: scheduled apart from its plan")
                self._grant(request, allocation)
                num_new = target - request.num_computed
                scheduled[request] = num_new
                budget -= num_new
                i += 1
            refused = len(allocations)
            if refused == len(plan):
                if queue:  # the admissions were made in the same call
                    i, budget = schedule_fitting(running, i, budget, scheduled, bs, caching)
                    if budget != left:
                        raise RuntimeError(f"planned a budget of {left} left, scheduled {budget}")
                    budget, more = self._admitted_by(schedule, queue, scheduled, left)
                    if more:
                        await self._admit(scheduled, budget, 2 * len(queue))
                    return scheduled
                continue
            for (index, _), num_sent in zip(plan[refused + 1 :], told[refused + 1 :], strict=True):
                running[index].num_sent = num_sent  # not tried: the manager has not heard
            i, budget = schedule_fitting(running, i, budget, scheduled, bs, caching)
            request = running[i]  # did not fit: preempt until it does or is the victim
            target = plan[refused][1]
            num_new = target - request.num_computed
            fits = False
            while not fits:
                victim_index = len(running) - 1 if lifo else 0
                victim = running.pop(victim_index)
                await self._preempt(victim)
                preempted = True
                budget += scheduled.pop(victim, 0)
                if victim is request:
                    break
                if victim_index < i:
                    i -= 1
                allocations = (
                    await self._allocate([SlotRequest(request.request_id, target)])
                ).allocations
                if allocations:
                    self._grant(request, allocations[0])
                    fits = True
            if not fits:
                continue  # `request` itself was preempted; running[i] is the next one
            scheduled[request] = num_new
            budget -= num_new
            i += 1

        if not preempted:
            await self._admit(scheduled, budget)
        return scheduled

    async def _admit(
        self, scheduled: dict[EngineRequest, int], budget: int, limit: int = 1
    ) -> None:
        """Admit waiting requests into ``scheduled``, first come first served, while the
        budget lasts and fewer than ``max_num_seqs`` run: vLLM's waiting loop, run by the
        manager (`KvClient.schedule`, with no running slot), unless `_queue` says the
        step admits nobody: a call hands over ``limit`` waiting requests, and while it
        admits them all the next hands over twice as many."""
        while True:
            queue = self._queue(budget, [], limit)
            if not queue:
                return
            schedule = await self._schedule_call([], queue, budget)
            budget, more = self._admitted_by(schedule, queue, scheduled, budget)
            if not more:
                return
            limit = 2 * len(queue)

    async def _schedule_call(
        self, slots: list[SlotRequest], queue: list[QueuedRequest], budget: int
    ) -> StepSchedule:
        """The step's `KvClient.schedule` of ``slots`` and ``queue`` with ``budget``
        tokens left after the slots, carrying the carried jump if any: the jump landed,
        then the step's allocations taken in (`_took`)."""
        carried = self._carried
        gate = self._gate(budget)
        if isinstance(carried, _Chain):
            self._carried = None  # sent once: see `_land_chain`
            schedule = await self.kv.schedule(slots, queue, gate, carried.message(self.config))
            self._land_chain(carried, schedule.run)
        else:
            run = None if carried is None else carried[0].run
            schedule = await self.kv.schedule(slots, queue, gate, run)
            self._land(schedule.run)
        self._took(None, schedule.step)
        return schedule

    def _queue(self, budget: int, plan: list[tuple[int, int]], limit: int) -> list[QueuedRequest]:
        """The waiting requests a step with ``budget`` tokens left after its running
        requests' ``plan`` (`plan_slots`) may reach, in order: one per free seat
        (``max_num_seqs``), at most ``limit`` (a long queue is not handed over whole each
        step: most of it waits), each with its prompt if the manager has not heard of it,
        and the one after the last seat if the manager knows it (its cost comes back).
        None when the step admits nobody: no budget or seat, or the head's cost known
        (any cost without prefix caching) and refused, the plan's growth counted (the
        cache may change only with prefix caching: a cost the allocations may change is
        not known)."""
        waiting = self.waiting
        seats = self.config.max_num_seqs - len(self.running)
        if not waiting or budget <= 0 or seats <= 0:
            return []
        head = waiting[0]
        cost: PrefillCost | None = _NO_COST
        if self.config.enable_prefix_caching:
            cost = None if plan else self._known_cost(head.request_id)
        if cost is not None:
            running = self.running
            bs = self.config.block_size
            growing = 0
            for index, target in plan:
                growing += max(0, -(-target // bs) - running[index].num_blocks)
            if self._admission(head, budget, cost, growing) is None:
                return []
        queue: list[QueuedRequest] = []
        for request in waiting:
            if len(queue) == seats:
                if request.registered:
                    queue.append(QueuedRequest(request.request_id))
                break
            if len(queue) == limit:
                break
            prompt = None
            if not request.registered:
                prompt = request.spec.prompt_token_runs(with_tokens=self._with_tokens)
            queue.append(QueuedRequest(request.request_id, prompt))
        return queue

    def _admitted_by(
        self,
        schedule: StepSchedule,
        queue: list[QueuedRequest],
        scheduled: dict[EngineRequest, int],
        budget: int,
    ) -> tuple[int, bool]:
        """Take in the admissions of a `KvClient.schedule` call that left ``budget``
        tokens after its slots: each admitted request leaves the queue for ``scheduled``
        with its cached prefix and this step's chunk, as the call's gate (as it was after
        the slots, moving on) admitted it; the first not admitted is known to the
        manager once the call reached it (its cost came back). Returns the budget left
        and whether every request handed over was admitted (more may be)."""
        bs = self.config.block_size
        waiting = self.waiting
        running = self.running
        allocations = schedule.step.allocations
        first = len(allocations) - len(schedule.costs)
        for cost, allocation in zip(schedule.costs, allocations[first:], strict=True):
            request = waiting[0]
            request.registered = True
            # the slots' blocks and the earlier admissions counted: the call's gate now
            admission = self._admission(request, budget, cost)
            if admission is None:
                raise RuntimeError(
                    f"{request.request_id}: the manager admitted what the gate refuses"
                )
            cached, num_new, fresh, inactive_cached = admission
            if allocation.cached_blocks * bs != cached:
                raise RuntimeError(
                    f"{request.request_id}: prefill_cost promised {cached // bs} cached "
                    f"blocks, allocate reused {allocation.cached_blocks}"
                )
            waiting.popleft()
            if request.first_scheduled_s is None:
                request.first_scheduled_s = self.clock  # the step's start
            request.cached_tokens += cached  # summed over admissions (RequestRecord)
            self._admitted[request.request_id] = cached
            self._num_active += fresh + inactive_cached
            request.num_blocks = runs_length(allocation.block_runs)
            request.num_computed = cached
            running.append(request)
            scheduled[request] = num_new
            budget -= num_new
        asked = schedule.step.cost
        if asked is not None and len(schedule.costs) < len(queue):
            waiting[0].registered = True  # reached: registered, or by this call
            self._remember_cost(waiting[0].request_id, asked)
        else:
            self._remember_cost(None, None)
        return budget, len(schedule.costs) == len(queue)

    async def _allocate(
        self, slots: list[SlotRequest], probe: str | None = None
    ) -> StepAllocations:
        """Allocate (and cache) ``slots`` in order while they fit, keeping the events and
        counters the call drained for this step's end; return the outcome (what fit, and
        ``probe``'s admission cost)."""
        if self._carried is not None:
            await self.settle()
        outcome = (await self.kv.allocate_steps([slots], probe))[0]
        self._took(probe, outcome)
        return outcome

    def _took(self, probe: str | None, outcome: StepAllocations) -> None:
        """Take in a step's allocations: ``probe``'s cost, and the events and counters
        the call drained, kept for this step's end."""
        self._remember_cost(probe, outcome.cost)
        if outcome.events:
            self._step_events.extend(outcome.events)
        read_counters(self.stats, outcome.stats)

    def _remember_cost(self, probe: str | None, cost: PrefillCost | None) -> None:
        """Keep what a cache-changing call answered for ``probe`` (None: nothing)."""
        self._head_cost = None if probe is None or cost is None else (probe, cost)

    def _known_cost(self, request_id: str) -> PrefillCost | None:
        """``request_id``'s admission cost if the last cache-changing call carried it
        (every such call sets or clears it, so it is current), else None."""
        known = self._head_cost
        return known[1] if known is not None and known[0] == request_id else None

    def _grant(self, request: EngineRequest, allocation: Allocation) -> None:
        """Count the fresh blocks a running request was given (the admission check's
        count included)."""
        self._grant_blocks(request, runs_length(allocation.block_runs))

    def _grant_blocks(self, request: EngineRequest, blocks: int) -> None:
        """`_grant` of a count of blocks."""
        self._num_active += blocks
        request.num_blocks += blocks

    async def _cost_now(self, request: EngineRequest) -> PrefillCost | None:
        """A registered waiting ``request``'s admission cost now (None without prefix
        caching): the one the last cache-changing call carried, else a query
        (`KvClient.prefill_cost`; nothing changes)."""
        if not self.config.enable_prefix_caching:
            return None
        cost = self._known_cost(request.request_id)
        if cost is None:
            await self.settle()
            cost = await self.kv.prefill_cost(request.request_id)
        return cost

    def _gate(self, budget: int, growing: int = 0) -> AdmissionGate:
        """The admission check's inputs now (`AdmissionGate`): ``budget`` tokens, what is
        free or evictable less ``growing`` blocks the step's running requests are about
        to take, the watermark, the running requests and the seats left."""
        config = self.config
        running = len(self.running)
        return AdmissionGate(
            budget,
            config.num_gpu_blocks - self._num_active - growing,
            self._watermark_blocks,
            running,
            config.max_num_seqs - running,
            config.enable_chunked_prefill,
            config.scheduler_reserve_full_isl,
        )

    def _admission(
        self,
        request: EngineRequest,
        budget: int,
        cost: PrefillCost | None,
        growing: int = 0,
    ) -> tuple[int, int, int, int] | None:
        """What admitting the waiting ``request`` within ``budget`` tokens at ``cost``
        (None without prefix caching) would take now: (cached tokens, new tokens, fresh
        blocks, inactive cached blocks it pins); None if it must wait. vLLM's check
        (`kvpool.manager.admission.admit_blocks`) of `_gate`'s inputs, read here without
        building one."""
        config = self.config
        cached_blocks = active_cached_blocks = 0
        if cost is not None:
            cached_blocks = cost.cached_blocks
            active_cached_blocks = cost.active_cached_blocks
        return admit_blocks(
            cached_blocks,
            active_cached_blocks,
            request.num_tokens,
            config.block_size,
            budget,
            config.num_gpu_blocks - self._num_active - growing,
            self._watermark_blocks,
            len(self.running),
            config.enable_chunked_prefill,
            config.scheduler_reserve_full_isl,
        )

    async def _flush(self, request: EngineRequest) -> None:
        """Hand the request's pending generated tokens to the manager."""
        await self.kv.append_tokens(request.request_id, request.take_pending())

    async def _preempt(self, request: EngineRequest) -> None:
        self._dirty = True
        self._head_cost = None
        await self.settle()
        if request.has_pending:
            await self._flush(request)
        await self.kv.preempt(request.request_id)
        request.num_computed = 0
        request.num_blocks = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self._preempted.append(request.request_id)
        self.waiting.appendleft(request)

    async def _execute(
        self, scheduled: dict[EngineRequest, int], duration_s: float | None = None
    ) -> tuple[float, list[str]]:
        """Advance the clock by the step's cost (or ``duration_s``), then apply its
        results."""
        kv = self.kv
        stats = self.stats
        bs = self.config.block_size
        work = step_work(scheduled, self._num_active, self.config.num_gpu_blocks, bs)
        duration = self.config.timing.duration(work) if duration_s is None else duration_s
        self.clock += duration
        now = self.clock
        stats.steps += 1
        stats.busy_s += duration
        stats.prefill_tokens += work.prefill_tokens
        stats.decode_tokens += work.decode_seqs

        updates, finished = apply_step(scheduled, now, stats, self.rank)
        if finished:
            self.running = [r for r in self.running if r.finish_s is None]
            for request_id in finished:
                self._ids.discard(request_id)

        events = self._step_events
        if updates or self._dirty:
            waiting = self.waiting
            probe = None
            if waiting and waiting[0].registered and self.config.enable_prefix_caching:
                probe = waiting[0].request_id
            outcome = await kv.finish_step(updates, probe)
            self._read_outcome(probe, outcome)
            events = events + outcome.events if events else outcome.events
        # else: nothing finished or was freed; this step's allocations drained their own
        # events and counters, and their blocks are in the engine's count
        self._end_step(events, now)
        return duration, finished
