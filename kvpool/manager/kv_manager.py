"""The request-level KV manager over a `BlockPool`: Dynamo's ``VllmKvManager`` in Python.

Synchronous and I/O-free (no asyncio, no anyio), like the pool it drives: a scheduler or
the manager actor calls it, and it queues the router-visible KV events for someone to drain.

Rules (``../shared/reference/NOTES.md``, "The manager" and "Router-visible KV events"):
- A request's *first* allocation (empty block table) walks its full-block hashes until
  the first miss and reuses that cached prefix, capped as vLLM caps it so that at least
  the request's last token is computed: at most ``(len(tokens) - 1) // block_size``
  blocks (vLLM's ``max_cache_hit_length = num_tokens - 1``).
  Later allocations take only fresh blocks; the API has no way to pass a prefix to them.
- An allocation is the pool's ``admit(prefix, fresh)`` (what ``reserve(prefix, fresh)``,
  ``activate_prefix``, ``allocate_private`` per fresh block and ``cancel`` do, in one
  call), then one BlockRemoved event for the hashes it evicted. When the blocks do not
  fit it returns None and changes nothing (no event, no counter).
- ``mark_computed`` moves the visibility watermark: a full block is ``cache_private``'d
  only once the computed-token count covers it whole, so a partial tail is promoted when
  it fills, and over-allocated future blocks stay private. ``allocate(..., cache=True)``
  is vLLM v1's ``allocate_slots``: it also moves the watermark to the allocated token
  count, so a scheduler makes a request's full blocks visible when it *schedules* them
  (vLLM advances ``num_computed_tokens`` at schedule time too) and a later request of
  the same step already hits them. A BlockStored event is queued
  only for 0 -> 1 transitions; consecutive ones of one call form one event whose parent
  is the first block's parent, and a block whose hash was already visible splits it.
- Preemption and completion release the table leaf first, so the leaf is evicted first.
- With ``enable_prefix_caching=False`` nothing is hashed, reused or cached: every block
  stays private, no event is ever queued, and no prefix hit is counted (queries are).
- With ``enable_kv_cache_events=False`` (vLLM's switch: events cost work, and without a
  subscriber nobody reads them) no event is built or queued, and everything else is the
  same; ``stats().kv_events`` still counts the events there would have been.
- With ``run_keys=True`` (events off only: no hash leaves the manager) a block is named
  by a cheap chained key of its tokens' runs (`kvpool.hashing.run_keys.RunKeyer`), not by
  Dynamo's xxh3 token hash, and no token is kept: a caller passing `TokenRuns` (a
  workload's segments) never has a token built. Keys are equal exactly when the tokens
  and prefixes are, so every count, cost and report is the same as with token hashes;
  only ``block_hashes`` (and `BlockPool` contents) show other numbers.

Compiled with mypyc as the pool core is (setup.py), with its validated parameters typed
``object`` for the reason `kvpool.pool.block_pool` gives; ``_api.pyi`` declares the
precise signatures type checkers read.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any, cast

from librt.vecs import vec
from mypy_extensions import i64

from kvpool.errors import (
    CapacityError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolationError,
    PoolError,
    TokenCountError,
    UnknownRequestError,
)
from kvpool.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from kvpool.hashing import BlockHasher, ChunkMemo
from kvpool.hashing.run_keys import RunKeyer, RunMemo
from kvpool.hashing.runs import TokenRuns
from kvpool.manager.admission import admit_blocks
from kvpool.manager.request import RequestState
from kvpool.manager.run_slots import last_in, slots_in
from kvpool.manager.types import (
    AdmissionGate,
    Allocation,
    ChainAllocations,
    DecodeChain,
    DecodeRun,
    DecodeStretch,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepSchedule,
    StepUpdate,
    StretchAllocations,
)
from kvpool.manager.validation import (
    check_count,
    check_request_id,
    check_timestamp,
    check_tokens,
    count_tokens,
)
from kvpool.pool import BlockId, BlockPool
from kvpool.pool.runs import (
    add_descent,
    add_run,
    expand,
    expand_descents,
    extend_runs,
    last_of,
    overlapping,
    run_at,
    runs_length,
    slice_runs,
    truncate_runs,
)

_NO_PREFIX: list[int] = []  # never changed: the chain of an allocation that reuses nothing
_NO_RUNS: list[int] = []  # never changed: no first copy among the blocks an allocation cached
_NO_MARKS = (-1, -1, -1)  # the marks of a step that starts with no known cost (unused)
_NOTHING = Allocation([], 0, [])  # never changed: a slot whose table did not grow
_NO_IDS: set[str] = set()  # never changed: the ids a one-slot step checks twice


class KvManager:
    """Per-request block tables over one `BlockPool`, emitting router-visible KV events.

    Not thread-safe; one owner drives it (a scheduler, or the manager actor). Every call
    validates all of its arguments first: a `kvpool.errors.PoolError` leaves the manager,
    the pool and the pending events exactly as they were.
    """

    __slots__ = (
        "_block_size",
        "_caching",
        "_events",
        "_hit_tokens",
        "_medium",
        "_memo",
        "_num_events",
        "_pool",
        "_preemptions",
        "_query_tokens",
        "_record_events",
        "_requests",
        "_reuses",
        "_run_keys",
        "_run_memo",
    )

    def __init__(
        self,
        pool: BlockPool,
        block_size: object,
        *,
        enable_prefix_caching: object = True,
        enable_kv_cache_events: object = True,
        medium: object = "GPU",
        run_keys: object = False,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"pool must be a BlockPool, got {pool!r}")
        if type(block_size) is not int or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        if type(enable_prefix_caching) is not bool:
            raise InvalidArgumentError(
                f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}"
            )
        if type(enable_kv_cache_events) is not bool:
            raise InvalidArgumentError(
                f"enable_kv_cache_events must be a bool, got {enable_kv_cache_events!r}"
            )
        if medium is not None and type(medium) is not str:
            raise InvalidArgumentError(f"medium must be a str or None, got {medium!r}")
        if type(run_keys) is not bool:
            raise InvalidArgumentError(f"run_keys must be a bool, got {run_keys!r}")
        if run_keys and enable_kv_cache_events:
            raise InvalidArgumentError(
                "run_keys needs enable_kv_cache_events=False: events carry Dynamo's hashes"
            )
        self._pool = pool
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._medium = medium
        # Shared by every request's hasher: a prompt that repeats another's prefix is
        # looked up chunk by chunk, not hashed again (`kvpool.hashing.memo`).
        self._run_keys = run_keys and enable_prefix_caching
        self._memo = ChunkMemo(block_size) if enable_prefix_caching and not run_keys else None
        # Token hashes of `TokenRuns` prompts' runs, shared by every request: a prefix
        # many prompts repeat is hashed once (run keys need no memo: `RunKeyer`).
        self._run_memo = RunMemo(block_size) if enable_prefix_caching and not run_keys else None
        self._requests: dict[str, RequestState] = {}
        self._events: list[KVEvent] = []
        self._record_events = enable_kv_cache_events
        self._num_events = 0  # queued so far, or with events off that would have been
        self._query_tokens = 0
        self._hit_tokens = 0
        self._preemptions = 0
        self._reuses = 0  # first allocations that reused a cached prefix

    def __repr__(self) -> str:
        return (
            f"KvManager(block_size={self._block_size}, requests={len(self._requests)}, "
            f"prefix_caching={self._caching}, pool={self._pool!r})"
        )

    # -------------------------------------------------------------- properties

    @property
    def pool(self) -> BlockPool:
        """The block pool this manager drives."""
        return self._pool

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether blocks are hashed, reused and made cache-visible."""
        return self._caching

    @property
    def enable_kv_cache_events(self) -> bool:
        """Whether router-visible events are built and queued (`take_events`)."""
        return self._record_events

    @property
    def run_keys(self) -> bool:
        """Whether blocks are named by run keys rather than Dynamo's token hashes."""
        return self._run_keys

    @property
    def medium(self) -> str | None:
        """The ``medium`` field of the events this manager emits."""
        return self._medium

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: object, prompt_token_ids: Sequence[int]) -> PrefillCost:
        """Register a request and its prompt; it holds no block until `allocate`.
        Returns its `prefill_cost` now (a scheduler's first question about a new
        request, answered in the same call).

        Raises `DuplicateRequestError` if ``request_id`` is registered, and
        `InvalidArgumentError` for an id that is not a str or a token outside u32.
        """
        rid, tokens = self._check_new(request_id, prompt_token_ids)
        state = self._requests[rid] = self._state_of(tokens)
        return self._cost_of(state)

    def _check_new(
        self, request_id: object, prompt_token_ids: Sequence[int]
    ) -> tuple[str, array[int] | TokenRuns | range]:
        """`add_request`'s checks: the id and the checked prompt."""
        rid = check_request_id(request_id)
        tokens = check_tokens(prompt_token_ids)
        if rid in self._requests:
            raise DuplicateRequestError(f"request {rid!r} is already registered")
        return rid, tokens

    def _state_of(self, tokens: array[int] | TokenRuns | range) -> RequestState:
        """A new request's state, its (checked) prompt named (hashed or keyed)."""
        if self._run_keys:
            state = RequestState(None, RunKeyer(self._block_size))
        else:
            hasher = BlockHasher(self._block_size, memo=self._memo) if self._caching else None
            state = RequestState(hasher, None, self._run_memo)
        state.extend(tokens)
        return state

    def append_tokens(self, request_id: object, token_ids: Sequence[int]) -> None:
        """Append (decoded) tokens to a request, hashing the blocks they complete.

        Raises `UnknownRequestError` or `InvalidArgumentError`.
        """
        state = self._get(request_id)
        state.extend(check_tokens(token_ids))

    def free(self, request_id: object) -> None:
        """Completion: release the request's blocks leaf first and forget the request.

        Raises `UnknownRequestError` if it is not registered (a double free included).
        """
        state = self._get(request_id)
        self._release_table(state)
        del self._requests[cast(str, request_id)]  # _get found it: a registered str

    def preempt(self, request_id: object) -> None:
        """Preemption: release the blocks leaf first but keep the request and its tokens.

        Its computed count drops to 0 and its next allocation is a first allocation
        again, which usually re-hits its own (now inactive) cached blocks. A request that
        holds no block is left as it is. Raises `UnknownRequestError`.
        """
        state = self._get(request_id)
        released = state.num_blocks > 0
        self._release_table(state)  # all or nothing: a refusal counts no preemption
        if released:
            self._preemptions += 1

    # -------------------------------------------------------------- allocation

    def prefill_cost(self, request_id: object) -> PrefillCost:
        """What the request's next allocation of all its tokens would need now.

        For a request holding no block: the prefix the first allocation would reuse
        (``cached_blocks``, ``active_cached_blocks``) and the fresh blocks for the rest.
        For a request already holding blocks: no cached blocks, and the fresh blocks still
        missing to hold every token it has. Raises `UnknownRequestError`.
        """
        return self._cost_of(self._get(request_id))

    def _cost_of(self, state: RequestState) -> PrefillCost:
        """`prefill_cost` of a request's state."""
        needed = -(-state.num_tokens // self._block_size)
        if state.num_blocks:
            return PrefillCost(0, 0, max(0, needed - state.num_blocks))
        if not self._caching or not state.num_tokens:
            return PrefillCost(0, 0, needed)
        cached, active = self._pool.match_runs(state.chain, self._prefix_limit(state))
        return PrefillCost(cached, active, max(0, needed - cached))

    def allocate(
        self,
        request_id: object,
        num_tokens: object,
        *,
        cache: object = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        """Grow the request's table to hold ``num_tokens`` tokens.

        ``new_tokens`` are appended first, as `append_tokens` would (a scheduler hands
        over the tokens generated since its last call with the allocation that needs
        them); they stay appended when the blocks do not fit (None).

        The first allocation (empty table) also reuses the resident cached prefix; the
        table then holds ``max(prefix, ceil(num_tokens / block_size))`` blocks and the
        request's computed count becomes ``prefix * block_size``. A table already large
        enough is left as it is (an empty `Allocation`).

        With ``cache`` (vLLM's ``allocate_slots``), once the blocks are in the table the
        computed count becomes ``max(computed, num_tokens)`` and the full blocks it
        covers become cache-visible, as `mark_computed` would make them: the scheduler
        passes the tokens it schedules, so they are visible from that moment on. An
        allocation that does not fit caches nothing.

        Returns the `Allocation`, or None when the blocks do not fit even after evicting
        every evictable inactive block (nothing changed, no event queued). Raises
        `UnknownRequestError`, `InvalidArgumentError` for a bad count, `TokenCountError`
        when ``num_tokens`` exceeds the request's tokens (``new_tokens`` included), and
        `CapacityError` when the table would need more blocks than the whole pool holds
        (it can never fit); every error is raised before anything changes.
        """
        state, count, appended, needed = self._check_allocation(request_id, num_tokens, new_tokens)
        if type(cache) is not bool:
            raise InvalidArgumentError(f"cache must be a bool, got {cache!r}")
        return self._grow(state, count, needed, appended, cache)

    def schedule(
        self, slots: object, queue: object, gate: object, run: object = None
    ) -> StepSchedule:
        """A step's scheduling in one call: the running requests' ``slots``, as
        `allocate_steps` of one step, then, if they all fit, vLLM's waiting loop over
        ``queue`` (`QueuedRequest` s, in order): while ``gate`` is open (budget and a
        seat left), a request is registered if it comes with its prompt (as
        `add_request`), its `prefill_cost` asked, and, if the gate lets it in at that
        cost (`kvpool.manager.admission.admit_blocks`), its first allocation made as
        ``SlotRequest(id, cached + new)`` would make it; the gate then moves on (its
        budget less the request's new tokens, its headroom less the blocks the pool's
        active count grew by, one more request running, one seat fewer). The loop stops at the first
        request refused (by the gate, or blocks that do not fit), which stays
        registered, waiting; requests after it are not touched. The headroom the loop
        starts from is the gate's less what the slots took.

        The outcome (`StepSchedule`) holds the step's allocations (slots', then
        admissions'), the events drained, the counters, each admitted request's cost,
        and the cost of the first request not admitted when the manager knows it
        (registered before or by this call), asked after everything: a scheduler's next
        question, answered in the same call. A step's KV work thus costs one call, and a
        request's arrival none: it reaches the manager with the first step that asks.

        With ``run`` (a `DecodeRun`), `allocate_run` of it (no probe) comes first, in
        the same call, and its result is the outcome's ``run``: the decode steps an
        engine jumped over up to this step ride on the step's call (`MockEngine`'s
        carried jump), so a jump to an arrival costs no call of its own. ``run`` may
        also be a `DecodeChain` (a carried chain of jumps that finished requests):
        `finish_chain` of it comes first then, and the gate's headroom is taken as
        counted before its frees, the blocks they released (the pool's active count
        before the chain plus its growth, less the count after it) added to it: the
        engine cannot count those until the manager answers.

        Checked before anything changes: the run as `allocate_run` checks it (a chain
        as `finish_chain` does), and that it fits whole (its growths within the free
        and evictable blocks, a chain's frees not counted); the slots as
        `allocate_steps` checks them (a request's new tokens in the run counted as heard
        before them, and none freed by a chain); each queued request registered (no
        prompt; holding no block: a queued request is new or preempted) or new (a
        prompt: as `add_request` checks it), named once, not among the slots and not
        freed by a chain, and its whole prompt within the pool
        (`CapacityError`: it could never run); the gate's fields. Raises `InvalidArgumentError`,
        `UnknownRequestError`, `DuplicateRequestError`, `CapacityError` or what
        `allocate_steps` raises.
        """
        if type(gate) is not AdmissionGate:
            raise InvalidArgumentError(f"expected an AdmissionGate, got {gate!r:.200}")
        raw: Any = gate  # read untyped until checked
        if (
            type(raw.budget) is not int
            or type(raw.headroom) is not int
            or type(raw.watermark) is not int
            or type(raw.running) is not int
            or type(raw.seats) is not int
            or raw.watermark < 0
            or raw.running < 0
            or raw.seats < 0
        ):
            raise InvalidArgumentError(
                f"a gate's counts are ints (watermark, running, seats >= 0): {gate!r}"
            )
        if type(raw.chunked) is not bool or type(raw.full_sequence) is not bool:
            raise InvalidArgumentError(f"a gate's chunked and full_sequence are bools: {gate!r}")
        budget: int = raw.budget
        headroom: int = raw.headroom
        watermark: int = raw.watermark
        running: int = raw.running
        seats: int = raw.seats
        chunked: bool = raw.chunked
        full_sequence: bool = raw.full_sequence
        ran: tuple[list[RequestState], list[array[int] | range], DecodeRun] | None = None
        chained: DecodeChain | None = None
        cuts: dict[str, int] = {}  # the requests a carried chain frees
        heard: dict[str, int] = {}
        growth = 0
        if run is not None:
            if type(run) is DecodeChain:
                chained = run
                run_states, run_tokens, growth, cuts = self._check_chain(run)
                checked_run = chained.run
            else:
                run_states, run_tokens, growth = self._check_run(run)
                checked_run = cast(DecodeRun, run)
            free = self._pool.capacity - self._pool.num_active()
            if growth > free:
                raise InvalidArgumentError(
                    f"a carried run must fit whole: it grows tables by {growth} blocks, "
                    f"{free} are free or evictable"
                )
            ran = (run_states, run_tokens, checked_run)
            for i in range(len(run_tokens)):  # all heard: every slot fits
                heard[checked_run.request_ids[i]] = len(run_tokens[i])
        running_slots = cast("Sequence[SlotRequest]", slots)
        checked = self._check_step(running_slots, heard)
        for slot in running_slots:
            if slot.request_id in cuts:
                raise InvalidArgumentError(
                    f"request {slot.request_id!r} is freed by the step's chain"
                )
        if type(queue) is not list:
            raise InvalidArgumentError(f"queue must be a list of QueuedRequest, got {queue!r:.200}")
        bs = self._block_size
        pool = self._pool
        named = {slot.request_id for slot in running_slots}
        # (id, state if registered, checked prompt if new): a new request's prompt is
        # named (hashed or keyed) only if the loop reaches it
        waiting: list[tuple[str, RequestState | None, array[int] | TokenRuns | range | None]] = []
        for queued in queue:
            if type(queued) is not QueuedRequest:
                raise InvalidArgumentError(f"expected a QueuedRequest, got {queued!r:.200}")
            entry: Any = queued
            prompt: object = entry.prompt_token_ids
            registered: RequestState | None = None
            tokens: array[int] | TokenRuns | range | None = None
            if prompt is None:
                registered = self._get(entry.request_id)
                rid = cast(str, entry.request_id)  # `_get` found it: a registered str
                if rid in cuts:
                    raise InvalidArgumentError(f"request {rid!r} is freed by the step's chain")
                if registered.num_blocks:
                    raise InvalidArgumentError(f"request {rid!r} holds blocks: it is not queued")
                length = registered.num_tokens
            else:
                rid, tokens = self._check_new(entry.request_id, cast("Sequence[int]", prompt))
                length = count_tokens(tokens)
            if rid in named:
                raise InvalidArgumentError(f"request {rid!r} appears twice in a step's schedule")
            named.add(rid)
            blocks = -(-length // bs)
            if blocks > pool.capacity:
                raise CapacityError(
                    f"request {rid!r} needs {blocks} blocks; the pool holds {pool.capacity}"
                )
            waiting.append((rid, registered, tokens))
        run_result: RunAllocations | ChainAllocations | None = None
        if chained is not None and ran is not None:
            before = pool.num_active()
            run_result = self._chain_checked(ran[0], ran[1], chained, cuts)
            headroom += before + growth - pool.num_active()  # what its frees released
        elif ran is not None:
            run_result = self._run_checked(*ran, None, -1, None)
        active = pool.num_active()
        allocations = self._grow_step(checked)
        costs: list[PrefillCost] = []
        asked = None
        if len(allocations) == len(checked):
            headroom -= pool.num_active() - active  # what the slots took is not free now
            for rid, registered, tokens in waiting:
                if budget <= 0 or seats <= 0:  # the gate is closed: nobody else is asked
                    if registered is not None:
                        asked = self._cost_of(registered)
                    break
                if registered is not None:
                    state = registered
                else:
                    assert tokens is not None
                    state = self._requests[rid] = self._state_of(tokens)
                cost = self._cost_of(state)
                admission = admit_blocks(
                    cost.cached_blocks,
                    cost.active_cached_blocks,
                    state.num_tokens,
                    bs,
                    budget,
                    headroom,
                    watermark,
                    running,
                    chunked,
                    full_sequence,
                )
                if admission is None:
                    asked = cost
                    break
                target = admission[0] + admission[1]
                before = pool.num_active()
                allocation = self._grow(state, target, -(-target // bs), None, True)
                if allocation is None:
                    asked = cost
                    break
                allocations.append(allocation)
                costs.append(cost)
                budget -= admission[1]
                headroom -= pool.num_active() - before
                running += 1
                seats -= 1
        return StepSchedule(
            StepAllocations(allocations, self.take_events(), self.stats(), asked),
            costs,
            run_result,
        )

    def allocate_step(self, slots: Sequence[SlotRequest], probe: object = None) -> StepAllocations:
        """One step's allocations: `allocate_steps` of ``[slots]``, its one result."""
        return self.allocate_steps([slots], probe)[0]

    def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: object = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        """A scheduler's allocations for one or more consecutive steps, in order: each
        slot is ``allocate(slot.request_id, slot.num_tokens, cache=True,
        new_tokens=slot.new_tokens)``, and after each step the events queued so far are
        drained and the counters read into that step's `StepAllocations`. A step whose
        only KV work is allocations then needs no `finish_step` (the scheduler knows the
        blocks it was given, so the occupancy too), a step's allocations cost one call,
        not one per request, and a run of decode steps whose only KV work is blocks
        filling and tables growing costs one call too, each step's events apart (a
        batch of its own, stamped with its own time).

        Stops at the first slot that does not fit: that step's ``allocations`` hold one
        `Allocation` per slot that fit, so when it is shorter than its slots, slot
        ``len(allocations)`` did not fit (its ``new_tokens`` stay appended, as with
        `allocate`), the step's later slots and the later steps were not tried
        (untouched), and the result has no entry for them. Every slot of every step is
        checked before any is allocated (a request's tokens counted with those its
        slots in earlier steps append): a slot `allocate` would refuse, a slot that is
        not a `SlotRequest`, a request named twice in one step, or no step at all
        raises `InvalidArgumentError` (or what `allocate` raises) before anything
        changes.

        ``probe`` names a request whose `prefill_cost` the last result carries, as asked
        after the allocations (``cost``; None without a probe and in earlier steps): the
        scheduler's next question (may the head of its queue be admitted now?) answered
        in the same call. With ``stop_if_cost_changes`` (the probe's cost as the caller
        last saw it), the probe's cost is asked after every step, and the call also
        stops after the first step that changed it, that step's result carrying the new
        cost: a scheduler whose queue's head waits for blocks takes a run of decode steps
        in one call, up to the step whose allocations may let the head in. Raises
        `UnknownRequestError` for an unknown probe, and `InvalidArgumentError` for
        ``stop_if_cost_changes`` without a probe or not a `PrefillCost`, before anything
        changes.
        """
        if (
            type(steps) is not list
            and (not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)))
        ) or not steps:
            raise InvalidArgumentError(
                f"steps must be a non-empty sequence of sequences of SlotRequest, got {steps!r}"
            )
        earlier: dict[str, int] = {}  # tokens appended by slots of earlier steps
        checked = [self._check_step(slots, earlier) for slots in steps]
        probe_state = None if probe is None else self._get(probe)
        watched = stop_if_cost_changes
        if watched is not None and (probe is None or type(watched) is not PrefillCost):
            raise InvalidArgumentError(
                f"stop_if_cost_changes needs a probe and a PrefillCost, got {watched!r}"
            )
        results: list[StepAllocations] = []
        last = len(checked) - 1
        known = None if watched is None else self.prefill_cost(probe)
        for index, step in enumerate(checked):
            marks = self._cost_marks() if known is not None else _NO_MARKS
            allocations = self._grow_step(step)
            stopped = len(allocations) < len(step)
            cost = None
            if probe is not None and (stopped or index == last or watched is not None):
                touched = any(checks[0] is probe_state for checks in step)
                asked = known = self._asked_cost(probe, known, marks, touched)
                if watched is not None and asked != watched:
                    stopped = True
                if stopped or index == last:
                    cost = asked  # only the last result carries the cost
            results.append(StepAllocations(allocations, self.take_events(), self.stats(), cost))
            if stopped:
                break
        return results

    def allocate_stretch(
        self,
        stretch: object,
        probe: object = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> StretchAllocations:
        """`allocate_steps` of the steps a `DecodeStretch` stands for (its ``steps()``),
        in its compact form: the same checks before anything changes, the same effect on
        the pool, the same stops and the same probed cost, and the result that
        ``StretchAllocations.of_steps`` of `allocate_steps`' results would be. A
        fast-forward jump's allocations cost one check per request and per slot, not a
        `SlotRequest`, a token list and a `StepAllocations` per step. (The engine's jumps
        use `allocate_run`, whose closed form this defines.)

        Every request of the stretch must hold blocks already (a decode stretch continues
        tables; none is a first allocation, so no counter but ``evictions`` and
        ``kv_events`` moves), be named once, and have every one of its ``new_tokens``
        placed by its slots' ``appends``; ``step_ends`` must not decrease, and end at the
        last slot. Anything else raises `InvalidArgumentError` (or what `allocate`
        raises) before anything changes.
        """
        if type(stretch) is not DecodeStretch:
            raise InvalidArgumentError(f"expected a DecodeStretch, got {stretch!r:.200}")
        # Checked through untyped views (a compiled typed read of a bad field or item
        # raises a bare TypeError); once checked, the fields are read as typed.
        raw: Any = stretch
        fields: tuple[object, ...] = (
            raw.request_ids,
            raw.new_tokens,
            raw.members,
            raw.targets,
            raw.appends,
            raw.step_ends,
        )
        if any(type(field) is not list for field in fields):
            raise InvalidArgumentError(
                f"a DecodeStretch's fields must be lists, got {stretch!r:.200}"
            )
        unchecked_ids: list[object] = raw.request_ids
        unchecked_members: list[object] = raw.members
        unchecked_targets: list[object] = raw.targets
        unchecked_appends: list[object] = raw.appends
        unchecked_ends: list[object] = raw.step_ends
        new_tokens = stretch.new_tokens
        n = len(unchecked_ids)
        slots = len(unchecked_members)
        if (
            len(new_tokens) != n
            or len(unchecked_targets) != slots
            or len(unchecked_appends) != slots
        ):
            raise InvalidArgumentError(
                "a stretch needs one new_tokens per request and one target and one "
                "appends per member"
            )
        if not unchecked_ends or unchecked_ends[-1] != slots:
            raise InvalidArgumentError("a stretch's step_ends must end at its last slot")
        states, tokens = self._decoding(unchecked_ids, new_tokens)
        placed = [0] * n  # each request's tokens placed by the slots checked so far
        held = [state.num_tokens for state in states]  # its token count at its next slot
        step_of = [-1] * n  # the last step that named each request
        bs = self._block_size
        capacity = self._pool.capacity
        most = capacity * bs  # the most tokens a table of the whole pool holds
        sizes = [len(new) for new in tokens]
        start = 0
        for step, unchecked_end in enumerate(unchecked_ends):
            if type(unchecked_end) is not int or not start <= unchecked_end <= slots:
                raise InvalidArgumentError(
                    f"step_ends must be ints that do not decrease, got {unchecked_ends!r:.200}"
                )
            end = unchecked_end
            for k in range(start, end):
                unchecked_member = unchecked_members[k]
                if type(unchecked_member) is not int or not 0 <= unchecked_member < n:
                    raise InvalidArgumentError(
                        f"member {unchecked_member!r} names no request of the stretch"
                    )
                member = unchecked_member
                raw_target = unchecked_targets[k]
                raw_count = unchecked_appends[k]
                target = (
                    raw_target
                    if type(raw_target) is int and raw_target >= 0
                    else check_count(raw_target, "num_tokens")
                )
                count = (
                    raw_count
                    if type(raw_count) is int and raw_count >= 0
                    else check_count(raw_count, "appends")
                )
                if step_of[member] == step:
                    raise InvalidArgumentError(
                        f"request {unchecked_ids[member]!r} appears twice in one step's allocations"
                    )
                step_of[member] = step
                now_placed = placed[member] + count
                placed[member] = now_placed
                if now_placed > sizes[member]:
                    raise InvalidArgumentError(
                        f"request {unchecked_ids[member]!r}: its slots append more tokens "
                        "than it was given"
                    )
                now_held = held[member] + count
                held[member] = now_held
                if target > now_held:
                    raise TokenCountError(
                        f"request {unchecked_ids[member]!r} has {now_held} tokens; cannot "
                        f"allocate for {target}"
                    )
                if target > most:
                    raise CapacityError(
                        f"request {unchecked_ids[member]!r} needs {-(-target // bs)} blocks; "
                        f"the pool holds {capacity}"
                    )
            start = end
        for i in range(n):
            if placed[i] != sizes[i]:
                raise InvalidArgumentError(
                    f"request {unchecked_ids[i]!r}: {sizes[i] - placed[i]} of its new "
                    "tokens are placed in no slot"
                )
        probe_member = self._probe_member(probe, stop_if_cost_changes, states)
        return self._stretch_slots(
            states, tokens, stretch, probe, probe_member, stop_if_cost_changes, False
        )

    def allocate_run(
        self,
        run: object,
        probe: object = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> RunAllocations:
        """`allocate_stretch` of the stretch a `DecodeRun` stands for (its
        ``stretch(block_size)``), in the run's closed form: the same checks before
        anything changes, the same effect on the pool and the counters, the same stops
        and probed cost, and its result per request and per group (`RunAllocations`)
        rather than per slot. With no probe and events off, when that is the same
        (`_run_at_once` says when), the run costs a step per request and per group: no
        slot is spelled out.

        Every request must hold blocks already, be named once and take part in some
        step (``grows`` and ``fills`` in ``[-1, steps)``, not both -1), its targets must
        stay within its tokens (its ``new_tokens`` included) and its table within the
        pool, and ``steps`` must be an int >= 1; anything else raises
        `InvalidArgumentError` (or `TokenCountError`, `CapacityError`,
        `UnknownRequestError`) before anything changes.
        """
        states, tokens, _ = self._check_run(run)
        probe_member = self._probe_member(probe, stop_if_cost_changes, states)
        return self._run_checked(
            states, tokens, cast(DecodeRun, run), probe, probe_member, stop_if_cost_changes
        )

    def _run_checked(
        self,
        states: list[RequestState],
        tokens: list[array[int] | range],
        checked: DecodeRun,
        probe: object,
        probe_member: int,
        stop_if_cost_changes: PrefillCost | None,
    ) -> RunAllocations:
        """`allocate_run` of a run already checked (`_check_run`, `_probe_member`)."""
        extended = False
        if probe is None and not self._record_events:
            at_once = self._run_at_once(states, tokens, checked)
            if type(at_once) is RunAllocations:
                return at_once
            extended = at_once is True
        stretch = checked.stretch(self._block_size)
        result = self._stretch_slots(
            states, tokens, stretch, probe, probe_member, stop_if_cost_changes, extended
        )
        return RunAllocations.of_stretch(stretch, result)

    def finish_run(
        self, run: object, updates: Sequence[StepUpdate]
    ) -> tuple[RunAllocations, StepOutcome]:
        """`allocate_run` of ``run`` (no probe), then `finish_step` of ``updates`` (no
        probe), in one call: `finish_stretch` for a run."""
        self._check_updates(updates, None)
        allocations = self.allocate_run(run)
        self._apply_updates(updates)
        return allocations, self._step_outcome(None)

    def finish_chain(self, chain: object) -> ChainAllocations:
        """`finish_run` of each segment of a `DecodeChain` (`DecodeChain.segments`), in
        order, in one call: its results joined (`ChainAllocations`). A segment whose run
        stops short (a slot that did not fit) ends the chain, its frees not made.

        The chain is checked before anything changes, and raises what `allocate_run`
        raises for its run (each request's slots ending at its leave), or
        `InvalidArgumentError` for leaves that are not ascending steps of the run, not
        one non-empty list of frees per leave, or a request freed twice, and
        `UnknownRequestError` for a request freed that is not registered.
        """
        states, tokens, _, cuts = self._check_chain(chain)
        return self._chain_checked(states, tokens, cast(DecodeChain, chain), cuts)

    def _check_chain(
        self, chain: object
    ) -> tuple[list[RequestState], list[array[int] | range], int, dict[str, int]]:
        """`finish_chain`'s checks of its chain, before anything changes: its run's
        requests' states and new tokens and the blocks its tables grow by
        (`_check_run`), and the step after which each request freed leaves."""
        if type(chain) is not DecodeChain:
            raise InvalidArgumentError(f"expected a DecodeChain, got {chain!r:.200}")
        raw: Any = chain  # read untyped until checked
        run: object = raw.run
        leaves: object = raw.leaves
        frees: object = raw.frees
        if type(run) is not DecodeRun or type(leaves) is not list or type(frees) is not list:
            raise InvalidArgumentError(
                f"a DecodeChain needs a DecodeRun and two lists, got {chain!r:.200}"
            )
        raw_run: Any = run  # a typed read of a bad field raises a bare TypeError
        steps: object = raw_run.steps
        if len(frees) != len(leaves):
            raise InvalidArgumentError("a DecodeChain needs one list of frees per leave")
        cuts: dict[str, int] = {}
        previous = -1
        for j in range(len(leaves)):
            leave: object = leaves[j]
            freed: object = frees[j]
            if type(leave) is not int or type(steps) is not int or not previous < leave < steps:
                raise InvalidArgumentError(
                    f"a DecodeChain's leaves must be ascending steps of its run: {leaves!r:.200}"
                )
            previous = leave
            if type(freed) is not list or not freed:
                raise InvalidArgumentError(
                    f"frees must be non-empty lists of request ids, got {freed!r:.200}"
                )
            for request_id in freed:
                self._get(request_id)
                if request_id in cuts:
                    raise InvalidArgumentError(f"request {request_id!r} is freed twice")
                cuts[request_id] = leave
        states, tokens, growth = self._check_run(run, cuts)
        return states, tokens, growth, cuts

    def _chain_checked(
        self,
        states: list[RequestState],
        tokens: list[array[int] | range],
        chain: DecodeChain,
        cuts: dict[str, int],
    ) -> ChainAllocations:
        """`finish_chain` of a chain `_check_chain` checked."""
        extended = False
        if not self._record_events:
            at_once = self._chain_at_once(states, tokens, chain, cuts)
            if type(at_once) is ChainAllocations:
                return at_once
            extended = at_once is True
        return self._chain_by_segments(chain, extended)

    def _chain_at_once(
        self,
        states: list[RequestState],
        tokens: list[array[int] | range],
        chain: DecodeChain,
        cuts: dict[str, int],
    ) -> ChainAllocations | bool:
        """A checked chain with events off, done as `_run_at_once` does a run, when that
        is what its segments one by one would do: returns its result, or False (nothing
        changed) or True (every request's new tokens appended, nothing else changed) for
        `finish_chain` to do it segment by segment.

        Each request's slots up to its leave are walked once, as two progressions, and
        its tokens heard and its blocks keyed once; each segment's growths are one
        `BlockPool.admit_each_runs`, then the blocks its leaving requests made visible
        are cached and they are freed; the rest is cached in one `cache_runs` at the end.
        That is the segments' result whenever `_run_at_once` would hold for each, which
        these make sure of before anything changes:
        - the chain's growths fit in the free and evictable blocks without its frees:
          a free only adds blocks (its cached ones at the LRU's tail), so each
          segment's evictions are then from the LRU as it was, a prefix of those the
          chain would make without frees;
        - every copy those evict is its hash's last;
        - no hash the chain caches is resident or cached twice: caching one then moves
          nothing (no LRU place, no eviction), whenever it happens.
        """
        pool = self._pool
        bs = self._block_size
        caching = self._caching
        run = chain.run
        leaves = chain.leaves
        steps = run.steps
        n = len(states)
        # the segments' last steps: each leave's, then the run's last if steps follow
        ends = list(leaves)
        if not ends or ends[-1] < steps - 1:
            ends.append(steps - 1)
        count = len(ends)
        highs: list[int] = []  # each request's last step: its leave's, or the run's
        first_visible = [state.visible for state in states]
        visible = list(first_visible)
        computed = [state.computed for state in states]
        # A request's table length, computed count and watermark after its slot at step
        # s depend only on s (its target grows by one a step), so the chain's growth and
        # last watermark come from its last slot, in closed form.
        total = 0
        slots = 0
        for i in range(n):
            high = cuts.get(run.request_ids[i], steps - 1)
            highs.append(high)
            grow = run.grows[i]
            fill = run.fills[i]
            slots += slots_in(grow, fill, high, bs)
            last = max(last_in(grow, 0, high, bs), last_in(fill, 0, high, bs))
            now = run.targets[i] + last
            need = -(-now // bs)
            if need > states[i].num_blocks:
                total += need - states[i].num_blocks
            if now > computed[i]:  # `_advance`, at its last slot
                computed[i] = now
                if caching and now // bs > visible[i]:
                    visible[i] = now // bs
        if not self._fits_at_once(total):
            return False
        cached = self._hear_all(states, tokens, first_visible, visible)
        if cached is None:
            return True
        leaving: list[list[int]] = [[] for _ in range(count)]  # each leave's requests
        place = {run.request_ids[i]: i for i in range(n)}
        for j in range(len(leaves)):
            for request_id in chain.frees[j]:
                i = place.get(request_id, -1)
                if i >= 0:
                    leaving[j].append(i)
        walk = _SlotWalk(run, states, highs, bs, caching)
        allocations: list[list[int]] = [[] for _ in range(n)]
        removed: list[int] = []
        kv_events: list[int] = []
        outcomes: list[StepOutcome] = []
        groups: list[int] = []
        stats = self.stats()
        events = self._num_events
        low = 0
        for j in range(count):
            high = ends[j]
            # a growth has its Removed event when the unallocated blocks ran out before
            # its last block (every copy evicted is its hash's last)
            room = pool.capacity - pool.num_active() - pool.num_inactive()
            groups_before = len(kv_events)
            events = walk.segment(low, high, room, events, kv_events)
            if len(kv_events) > groups_before:  # the segment has slots
                growers = sorted(walk.touched)  # request order: one admission each
                grows = [walk.grown[i] for i in growers]
                walk.clear()
                if growers:
                    tails = [last_of(states[i].table) for i in growers]
                    taken = pool.admit_each_runs(grows, tails)
                    if taken is None:  # unreachable: the total fits
                        raise InvariantViolationError("a chain's admissions did not fit after all")
                    ids, removed_runs = taken
                    next_id = 0
                    for g in range(len(growers)):
                        new_ids = slice_runs(ids, next_id, next_id + grows[g])
                        next_id += grows[g]
                        state = states[growers[g]]
                        extend_runs(state.table, new_ids)
                        state.num_blocks += grows[g]
                        extend_runs(allocations[growers[g]], new_ids)
                    for r in range(0, len(removed_runs), 2):
                        add_descent(removed, removed_runs[r], removed_runs[r + 1])
                self._num_events = events
                stats = self.stats()
            if j < len(leaves):
                self._cache_some(states, computed, first_visible, visible, leaving[j])
                for request_id in chain.frees[j]:
                    self.free(request_id)
                outcomes.append(self._step_outcome(None))
                groups.append(len(kv_events))
            low = high + 1
        staying = [i for i in range(n) if run.request_ids[i] not in cuts]
        self._cache_some(states, computed, first_visible, visible, staying)
        return ChainAllocations(
            RunAllocations(
                [Allocation(blocks, 0, []) for blocks in allocations],
                slots,
                removed,
                kv_events,
                [],
                stats,
                None,
            ),
            outcomes,
            groups,
        )

    def _cache_some(
        self,
        states: list[RequestState],
        computed: list[int],
        first_visible: list[int],
        visible: list[int],
        members: list[int],
    ) -> None:
        """`_cache_all` of the requests ``members`` only (`_chain_at_once`): their
        computed counts and watermarks, and their newly visible blocks cached."""
        blocks: list[int] = []
        hashes: list[int] = []
        for i in members:
            state = states[i]
            state.computed = computed[i]
            if visible[i] > first_visible[i]:
                extend_runs(
                    blocks, slice_runs(state.table, first_visible[i], visible[i], state.num_blocks)
                )
                extend_runs(
                    hashes, slice_runs(state.chain, first_visible[i], visible[i], state.num_hashed)
                )
                state.visible = visible[i]
        if hashes and self._pool.cache_runs(blocks, hashes) != [0, runs_length(hashes)]:
            # unreachable: no hash was resident or cached twice
            raise InvariantViolationError("a chain cached a hash resident already")

    def _chain_by_segments(self, chain: DecodeChain, extended: bool) -> ChainAllocations:
        """`finish_chain` of a checked chain, segment by segment; with ``extended``, every
        request's new tokens were appended already."""
        run = chain.run
        place = {run.request_ids[i]: i for i in range(len(run.request_ids))}
        joined: list[list[int]] = [[] for _ in run.request_ids]
        removed: list[int] = []
        kv_events: list[int] = []
        events: list[tuple[int, list[KVEvent]]] = []
        outcomes: list[StepOutcome] = []
        groups: list[int] = []
        slots = 0
        stats = self.stats()
        for piece, updates in chain.segments(self._block_size):
            stopped = False
            if piece is not None:
                states, tokens, growth = self._check_run(piece)
                if extended:
                    stretch = piece.stretch(self._block_size)
                    result = RunAllocations.of_stretch(
                        stretch,
                        self._stretch_slots(states, tokens, stretch, None, -1, None, True),
                    )
                else:
                    result = self._run_checked(states, tokens, piece, None, -1, None)
                grown = 0
                for k in range(len(result.allocations)):
                    blocks = result.allocations[k].block_runs
                    grown += runs_length(blocks)
                    extend_runs(joined[place[piece.request_ids[k]]], blocks)
                removed_runs = result.removed_runs
                for r in range(0, len(removed_runs), 2):
                    add_descent(removed, removed_runs[r], removed_runs[r + 1])
                offset = len(kv_events)
                events.extend((group + offset, queued) for group, queued in result.events)
                kv_events.extend(result.kv_events)
                slots += result.slots
                stats = result.stats
                stopped = grown < growth
            if stopped:
                break
            if updates:
                self._apply_updates(updates)
                outcomes.append(self._step_outcome(None))
                groups.append(len(kv_events))
        allocations = [Allocation(blocks, 0, []) for blocks in joined]
        return ChainAllocations(
            RunAllocations(allocations, slots, removed, kv_events, events, stats, None),
            outcomes,
            groups,
        )

    def _check_run(
        self, run: object, cuts: dict[str, int] | None = None
    ) -> tuple[list[RequestState], list[array[int] | range], int]:
        """`allocate_run`'s checks of its run, before anything changes: the requests'
        states and new tokens (`_decoding`), and the blocks its tables grow by if every
        slot fits (each growth takes a fresh block, so they all fit exactly when these
        do: `schedule` requires it of a run it carries). ``cuts`` (`finish_chain`'s)
        names the requests whose slots end early, each with its last step."""
        if type(run) is not DecodeRun:
            raise InvalidArgumentError(f"expected a DecodeRun, got {run!r:.200}")
        raw: Any = run  # read untyped until checked, as `allocate_stretch` does
        fields: tuple[object, ...] = (
            raw.request_ids,
            raw.new_tokens,
            raw.targets,
            raw.grows,
            raw.fills,
        )
        if any(type(field) is not list for field in fields):
            raise InvalidArgumentError(
                f"a DecodeRun's fields but steps must be lists, got {run!r:.200}"
            )
        steps: object = raw.steps
        if type(steps) is not int or steps < 1:
            raise InvalidArgumentError(f"a DecodeRun's steps must be an int >= 1, got {steps!r}")
        unchecked_ids: list[object] = raw.request_ids
        unchecked_targets: list[object] = raw.targets
        unchecked_grows: list[object] = raw.grows
        unchecked_fills: list[object] = raw.fills
        n = len(unchecked_ids)
        if (
            len(raw.new_tokens) != n
            or len(unchecked_targets) != n
            or len(unchecked_grows) != n
            or len(unchecked_fills) != n
        ):
            raise InvalidArgumentError("a DecodeRun needs one of each field per request")
        states, tokens = self._decoding(unchecked_ids, run.new_tokens)
        bs = self._block_size
        most = self._pool.capacity * bs  # the most tokens a table of the whole pool holds
        growth = 0
        for i in range(n):
            target = unchecked_targets[i]
            grow = unchecked_grows[i]
            fill = unchecked_fills[i]
            if type(target) is not int or target < 0:
                raise InvalidArgumentError(f"targets must be ints >= 0, got {target!r}")
            if type(grow) is not int or not -1 <= grow < steps:
                raise InvalidArgumentError(f"grows must be ints in [-1, {steps}), got {grow!r}")
            if type(fill) is not int or not -1 <= fill < steps:
                raise InvalidArgumentError(f"fills must be ints in [-1, {steps}), got {fill!r}")
            if grow < 0 and fill < 0:
                raise InvalidArgumentError(
                    f"request {unchecked_ids[i]!r} takes part in no step of the run"
                )
            # its last slot's step, and its first: it hears a token a step from its first
            # slot on, the rest with the first
            high = steps - 1 if cuts is None else cuts.get(cast(str, unchecked_ids[i]), steps - 1)
            last = -1
            first = steps
            if 0 <= grow <= high:
                last = grow + (high - grow) // bs * bs
                first = grow
            if 0 <= fill <= high:
                last = max(last, fill + (high - fill) // bs * bs)
                first = min(first, fill)
            if last < 0:
                raise InvalidArgumentError(
                    f"request {unchecked_ids[i]!r} takes part in no step before it leaves"
                )
            span = last - first
            if len(tokens[i]) < span:
                raise InvalidArgumentError(
                    f"request {unchecked_ids[i]!r}: {len(tokens[i])} new tokens, but a token "
                    f"a step for the {span} steps to its last slot"
                )
            top = target + last  # its last slot's target: the largest
            held = states[i].num_tokens + len(tokens[i])
            if top > held:
                raise TokenCountError(
                    f"request {unchecked_ids[i]!r} has {held} tokens; cannot allocate for {top}"
                )
            if top > most:
                raise CapacityError(
                    f"request {unchecked_ids[i]!r} needs {-(-top // bs)} blocks; "
                    f"the pool holds {self._pool.capacity}"
                )
            growth += max(0, -(-top // bs) - states[i].num_blocks)
        return states, tokens, growth

    def _run_at_once(
        self, states: list[RequestState], tokens: list[array[int] | range], run: DecodeRun
    ) -> RunAllocations | bool:
        """A checked run with no probe and events off, done in closed form when that is
        what its stretch slot by slot would do: returns its result, or False (nothing
        changed) or True (every request's new tokens appended, nothing else changed)
        for `allocate_run` to do it slot by slot.

        Each request's slots are walked as two progressions (its table's growths, its
        blocks' fills), with no slot spelled out: the blocks each grows by and the
        slots per group that make blocks visible (one Stored event each). Its blocks are
        taken in one `BlockPool.admit_each_runs` (one admission per request, in request
        order: the evictions are the stretch's, from the LRU head) and cached in one
        `cache_runs`. That is the stretch's result whenever
        - every slot fits: admissions only take, so they do if the run's total does;
        - no hash the run caches is resident or cached twice: then caching a block
          changes neither the LRU nor any eviction, and each is its hash's first copy;
        - every copy the run evicts is its hash's last (`BlockPool.evicts_last_copies`):
          as the stretch counts one Removed event per growth that evicted a last copy,
          a growth then has its Removed event exactly when free capacity ran out before
          its last block, in slot order.
        """
        pool = self._pool
        bs = self._block_size
        caching = self._caching
        steps = run.steps
        n = len(states)
        first_visible = [state.visible for state in states]
        visible = list(first_visible)
        computed = [state.computed for state in states]
        counts: list[int] = []  # per growing request, the blocks it grows by
        tails: list[int] = []  # and its table's last block before the run
        growers: list[int] = []  # and its index
        # Every slot as one int, (step * n + request) * 4 + 2 if its table grows + 1 if
        # it makes blocks visible: sorted, the slots in the stretch's order.
        slots: list[int] = []
        bulk: dict[int, int] = {}  # a slot's growth of more than one block (step 0 only)
        total = 0
        for i in range(n):
            target = run.targets[i]
            next_grow = run.grows[i]
            next_fill = run.fills[i]
            if next_grow < 0:
                next_grow = steps
            if next_fill < 0:
                next_fill = steps
            length = states[i].num_blocks
            done = computed[i]
            seen = visible[i]
            blocks = 0
            while True:
                step = next_grow if next_grow < next_fill else next_fill
                if step >= steps:
                    break
                if step == next_grow:
                    next_grow += bs
                if step == next_fill:
                    next_fill += bs
                now = target + step
                need = -(-now // bs)
                key = (step * n + i) * 4
                if need > length:
                    key += 2
                    if need - length > 1:
                        bulk[key] = need - length
                    blocks += need - length
                    length = need
                if now > done:  # `_advance`
                    done = now
                    if caching and now // bs > seen:
                        seen = now // bs
                        key += 1
                slots.append(key)
            computed[i] = done
            visible[i] = seen
            if blocks:
                counts.append(blocks)
                tails.append(last_of(states[i].table))
                growers.append(i)
                total += blocks
        if not self._fits_at_once(total):
            return False
        free = pool.capacity - pool.num_active() - pool.num_inactive()  # no eviction needed
        cached = self._hear_all(states, tokens, first_visible, visible)
        if cached is None:
            return True
        taken = pool.admit_each_runs(counts, tails)
        if taken is None:  # unreachable: the total fits
            raise InvariantViolationError("a run's admissions did not fit after all")
        ids, removed_runs = taken
        allocations = [_NOTHING] * n
        next_id = 0
        for g in range(len(counts)):
            new_ids = slice_runs(ids, next_id, next_id + counts[g])
            next_id += counts[g]
            state = states[growers[g]]
            extend_runs(state.table, new_ids)
            state.num_blocks += counts[g]
            allocations[growers[g]] = Allocation(new_ids, 0, [])
        # A growth has its Removed event when free capacity ran out before its last
        # block (every copy evicted is its hash's last): in slot order, group by group.
        slots.sort()
        kv_events: list[int] = []
        events = self._num_events
        used = 0
        group = -1
        per_step = 4 * n
        for key in slots:
            step = key // per_step
            if step != group:
                if group >= 0:
                    kv_events.append(events)
                group = step
            if key & 2:
                used += bulk.get(key - (key & 1), 1) if bulk else 1
                if used > free:
                    events += 1
            if key & 1:
                events += 1
        kv_events.append(events)
        self._num_events = events
        self._cache_all(states, computed, first_visible, visible, cached)
        return RunAllocations(
            allocations, len(slots), removed_runs, kv_events, [], self.stats(), None
        )

    def _decoding(
        self, unchecked_ids: list[object], new_tokens: list[Sequence[int]]
    ) -> tuple[list[RequestState], list[array[int] | range]]:
        """The checks of a stretch's (or a run's) requests, before anything changes: each
        registered, named once and holding blocks (a decode continues tables), its new
        tokens valid; their states and their new tokens (``TokenRuns`` as an array, to
        be sliced a slot's share at a time)."""
        states: list[RequestState] = []
        tokens: list[array[int] | range] = []
        seen: set[str] = set()
        for i in range(len(unchecked_ids)):
            state = self._get(unchecked_ids[i])
            request_id = cast(str, unchecked_ids[i])  # `_get` found it: a registered str
            if request_id in seen:
                raise InvalidArgumentError(f"request {request_id!r} appears twice in a stretch")
            seen.add(request_id)
            if not state.num_blocks:
                raise InvalidArgumentError(
                    f"request {request_id!r} holds no block: a stretch continues tables"
                )
            checked = check_tokens(new_tokens[i])
            given: array[int] | range
            if type(checked) is TokenRuns:  # not isinstance: an ABC's check is slow
                given = checked.to_array()
            else:
                given = cast("array[int] | range", checked)
            states.append(state)
            tokens.append(given)
        return states, tokens

    def _probe_member(self, probe: object, watched: object, states: list[RequestState]) -> int:
        """A stretch's (or a run's) probe checks, before anything changes; the index of
        the probe among ``states`` (-1: none of them)."""
        probe_state = None if probe is None else self._get(probe)
        if watched is not None and (probe is None or type(watched) is not PrefillCost):
            raise InvalidArgumentError(
                f"stop_if_cost_changes needs a probe and a PrefillCost, got {watched!r}"
            )
        for i in range(len(states)):
            if states[i] is probe_state:
                return i
        return -1

    def _stretch_slots(
        self,
        states: list[RequestState],
        tokens: list[array[int] | range],
        stretch: DecodeStretch,
        probe: object,
        probe_member: int,
        watched: PrefillCost | None,
        extended: bool,
    ) -> StretchAllocations:
        """A checked stretch slot by slot (`allocate_stretch`); with ``extended``, every
        request's new tokens were appended already."""
        members = stretch.members
        targets = stretch.targets
        appends = stretch.appends
        ends = stretch.step_ends
        bs = self._block_size
        n = len(states)
        allocations: list[Allocation] = []
        kv_events: list[int] = []
        events: list[tuple[int, list[KVEvent]]] = []
        cost = None
        known = None if watched is None else self.prefill_cost(probe)
        last = len(ends) - 1
        used = [0] * n
        start = 0
        for step, end in enumerate(ends):
            marks = self._cost_marks() if known is not None else _NO_MARKS
            stopped = False
            touched = False
            for k in range(start, end):
                member = members[k]
                count = appends[k]
                appended = None
                if count and not extended:
                    offset = used[member]
                    used[member] = offset + count
                    appended = tokens[member][offset : offset + count]
                touched = touched or member == probe_member
                target = targets[k]
                allocation = self._grow(states[member], target, -(-target // bs), appended, True)
                if allocation is None:
                    stopped = True
                    break
                allocations.append(allocation)
            if probe is not None and (stopped or step == last or watched is not None):
                asked = known = self._asked_cost(probe, known, marks, touched)
                if watched is not None and asked != watched:
                    stopped = True
                if stopped or step == last:
                    cost = asked
            kv_events.append(self._num_events)
            if self._events:
                events.append((step, self.take_events()))
            if stopped:
                break
            start = end
        return StretchAllocations(allocations, kv_events, events, self.stats(), cost)

    def _fits_at_once(self, total: int) -> bool:
        """Whether ``total`` fresh blocks fit as a closed-form run needs them: within the
        free and evictable blocks, each copy they evict its hash's last (a run's first
        two conditions, `_run_at_once`)."""
        pool = self._pool
        free = pool.capacity - pool.num_active()
        if total > free:
            return False
        free -= pool.num_inactive()  # what no eviction is needed for
        return total <= free or pool.evicts_last_copies(total - free)

    def _hear_all(
        self,
        states: list[RequestState],
        tokens: list[array[int] | range],
        first_visible: list[int],
        visible: list[int],
    ) -> list[int] | None:
        """`_run_at_once`'s appending of every request's new tokens; then the hashes of
        the blocks each makes visible (from ``first_visible`` up to ``visible``), request
        by request, or None when one of them is resident or cached twice (caching them
        at once would not be the same)."""
        for i in range(len(states)):
            if len(tokens[i]):
                states[i].extend(tokens[i])
        cached: list[int] = []
        if self._caching:
            for i in range(len(states)):
                if visible[i] > first_visible[i]:
                    state = states[i]
                    extend_runs(
                        cached,
                        slice_runs(state.chain, first_visible[i], visible[i], state.num_hashed),
                    )
            if cached and (overlapping(cached) or self._pool.any_resident_runs(cached)):
                return None
        return cached

    def _cache_all(
        self,
        states: list[RequestState],
        computed: list[int],
        first_visible: list[int],
        visible: list[int],
        cached: list[int],
    ) -> None:
        """`_run_at_once`'s end: each request's computed count and watermark, and its
        newly visible blocks cached under ``cached`` (`_hear_all`'s), in one call."""
        blocks: list[int] = []  # in the order of ``cached``
        for i in range(len(states)):
            state = states[i]
            state.computed = computed[i]
            if visible[i] > first_visible[i]:
                extend_runs(
                    blocks, slice_runs(state.table, first_visible[i], visible[i], state.num_blocks)
                )
                state.visible = visible[i]
        if cached and self._pool.cache_runs(blocks, cached) != [0, runs_length(cached)]:
            # unreachable: no hash was resident or cached twice
            raise InvariantViolationError("a decode cached a hash resident already")

    def _cost_marks(self) -> tuple[int, int, int]:
        """What a queued request's `prefill_cost` depends on besides its own tokens: the
        pool's first copies of hashes and whether they are held change only through an
        eviction, a hash made resident (a Stored event, counted with events off too) or
        a prefix reused (a first allocation pins it)."""
        return (self._pool.evictions, self._num_events, self._reuses)

    def _asked_cost(
        self,
        probe: object,
        known: PrefillCost | None,
        marks: tuple[int, int, int],
        touched: bool,
    ) -> PrefillCost:
        """``probe``'s cost now: ``known`` (its cost when `_cost_marks` were ``marks``)
        if none of them moved since and the probe took no slot (``touched``), else
        asked again."""
        if known is not None and not touched and marks == self._cost_marks():
            return known
        return self.prefill_cost(probe)

    def _check_step(
        self, slots: Sequence[SlotRequest], earlier: dict[str, int]
    ) -> list[tuple[RequestState, int, array[int] | TokenRuns | range | None, int]]:
        """`allocate_steps`' checks of one step's slots, before anything changes;
        ``earlier`` (request id -> tokens appended by earlier steps' slots) grows by
        this step's."""
        if type(slots) is not list and (
            not isinstance(slots, Sequence) or isinstance(slots, (str, bytes))
        ):
            raise InvalidArgumentError(f"slots must be a sequence of SlotRequest, got {slots!r}")
        checked: list[tuple[RequestState, int, array[int] | TokenRuns | range | None, int]] = []
        several = len(slots) > 1  # one slot cannot name its request twice
        seen: set[str] = set() if several else _NO_IDS
        for slot in slots:
            if type(slot) is not SlotRequest:
                raise InvalidArgumentError(f"expected a SlotRequest, got {slot!r}")
            raw: Any = slot  # read untyped: a typed read of a bad field raises a bare TypeError
            request_id = check_request_id(raw.request_id)
            if several:
                if request_id in seen:
                    raise InvalidArgumentError(
                        f"request {request_id!r} appears twice in one step's allocations"
                    )
                seen.add(request_id)
            before = earlier.get(request_id, 0) if earlier else 0
            state, count, appended, needed = self._check_allocation(
                request_id, raw.num_tokens, raw.new_tokens, before
            )
            if appended is not None:
                earlier[request_id] = before + len(appended)
            checked.append((state, count, appended, needed))
        return checked

    def _grow_step(
        self, checked: list[tuple[RequestState, int, array[int] | TokenRuns | range | None, int]]
    ) -> list[Allocation]:
        """A step's slots, checked (`_check_step`), allocated and cached in order while
        they fit: their allocations (fewer than the slots: the next did not fit)."""
        allocations: list[Allocation] = []
        for state, num_tokens, appended, needed in checked:
            allocation = self._grow(state, num_tokens, needed, appended, True)
            if allocation is None:
                break
            allocations.append(allocation)
        return allocations

    def _check_allocation(
        self, request_id: object, num_tokens: object, new_tokens: Sequence[int], earlier: int = 0
    ) -> tuple[RequestState, int, array[int] | TokenRuns | range | None, int]:
        """`allocate`'s checks, before anything changes: the request's state, the token
        count, the ``new_tokens`` to append (None: none), the blocks the count needs;
        ``earlier`` tokens will have been appended first (`allocate_steps`)."""
        state = self._get(request_id)
        num_tokens = check_count(num_tokens, "num_tokens")
        appended = None if new_tokens == () or new_tokens == [] else check_tokens(new_tokens)
        total = state.num_tokens + earlier + (len(appended) if appended is not None else 0)
        if num_tokens > total:
            raise TokenCountError(
                f"request {request_id!r} has {total} tokens; cannot allocate for {num_tokens}"
            )
        needed = -(-num_tokens // self._block_size)
        # A reused prefix is resident, so it never outgrows the pool: checked here, this
        # is the only way the table can, and nothing has changed yet.
        if needed > self._pool.capacity:
            raise CapacityError(
                f"request {request_id!r} needs {needed} blocks; the pool holds "
                f"{self._pool.capacity}"
            )
        return state, num_tokens, appended, needed

    def _grow(
        self,
        state: RequestState,
        num_tokens: int,
        needed: int,
        appended: array[int] | TokenRuns | range | None,
        cache: bool,
    ) -> Allocation | None:
        """`allocate` after its checks (`_check_allocation`)."""
        if appended is not None:
            state.extend(appended)
        grown = state.num_blocks
        if grown and needed <= grown:  # the common decode step: nothing to add
            if cache:
                self._advance(state, num_tokens)
            return Allocation([], 0, [])
        # One pool call: a first allocation's reused prefix (walked in this same call up
        # to its first miss, leaving the last token to compute: vLLM's ``num_tokens - 1``
        # cap) referenced, then private copies up to the blocks the count needs,
        # evicting as reserve-then-allocate would. A later allocation adds fresh ones.
        # With ``cache``, the fresh blocks the count fills whole are cached in the same
        # call (`_advance` below caches the older ones the watermark passes).
        bs = self._block_size
        full = num_tokens // bs if cache and self._caching else 0
        pool = self._pool
        if grown:
            if full > grown:
                admission = pool.admit_runs(
                    slice_runs(state.chain, grown, full),
                    blocks=needed - grown,
                    limit=0,
                    cache=full - grown,
                )
            else:
                admission = pool.admit_runs(
                    _NO_PREFIX, blocks=needed - grown, after=last_of(state.table)
                )
        else:
            chain = _NO_PREFIX
            limit = 0
            if self._caching and state.num_tokens:
                chain = state.chain
                limit = (state.num_tokens - 1) // bs
            if not needed and (not limit or not pool.match_runs(chain, limit)[0]):
                return Allocation([], 0, [])  # an empty table asked for 0 tokens, no prefix
            admission = pool.admit_runs(chain, blocks=needed, limit=limit, cache=full)
        if admission is None:
            return None
        removed = admission.removed
        if removed:
            self._num_events += 1
            if self._record_events:
                self._events.append(
                    BlockRemoved(block_hashes=expand_descents(removed), medium=self._medium)
                )
        reused = admission.cached
        if reused:
            self._reuses += 1
        if not grown:
            if self._caching:  # as vLLM, no prefix-cache stats without a prefix cache
                self._query_tokens += state.num_tokens
                self._hit_tokens += reused * bs
            state.computed = reused * bs
            state.visible = reused
            grown = reused
        extend_runs(state.table, admission.ids)
        state.num_blocks += runs_length(admission.ids)
        if cache:
            self._advance(state, num_tokens, grown, admission.stored, max(full - grown, 0))
        return Allocation(admission.ids, reused, removed)

    def undo_allocation(self, request_id: object, allocation: Allocation) -> bool:
        """Give back what `allocate` added, leaf first: the hook for a caller that never
        saw the allocation (the actor's cancellation contract).

        When the request's table still ends with ``allocation.block_ids``, those blocks
        are released leaf first and dropped from the table, and the computed count is
        clipped to the slots left (an undone first allocation leaves the request as if
        never allocated: computed 0, next allocation first again). Returns True then,
        and also for an empty allocation. Returns False, changing nothing, when there is
        nothing left to undo: the request was freed or preempted since (its blocks are
        already back) or its table no longer ends with those blocks.

        A reused prefix copy going idle returns to its LRU place (`BlockPool.unadmit`).
        What is *not* undone: evictions (the evicted hashes are gone; their BlockRemoved
        event stays queued and counted), the prefix-cache query counters, and Stored
        events of blocks made visible since (those copies stay resident, idle at the
        LRU's head: the first to be evicted, as the newest never-used copies).
        Raises `InvalidArgumentError` for a bad request id or allocation.
        """
        rid = check_request_id(request_id)
        if type(allocation) is not Allocation:
            raise InvalidArgumentError(f"expected an Allocation, got {allocation!r}")
        state = self._requests.get(rid)
        ids = allocation.block_ids
        if not ids:
            return True
        if state is None or state.num_blocks < len(ids):
            return False
        kept = state.num_blocks - len(ids)
        tail = slice_runs(state.table, kept, state.num_blocks)
        if expand(tail) != ids:
            return False
        self._pool.unadmit_runs(tail)
        truncate_runs(state.table, kept)
        state.num_blocks = kept
        state.computed = min(state.computed, kept * self._block_size)
        if self._caching:
            state.visible = state.computed // self._block_size
        return True

    def mark_computed(self, request_id: object, num_computed_tokens: object) -> None:
        """Record the scheduler's computed-token count and publish the full blocks it covers.

        Every table block the count covers whole becomes cache-visible; a BlockStored
        event is queued for each run of blocks whose hash had no resident copy before.
        Raises `UnknownRequestError`, `InvalidArgumentError`, and `TokenCountError` when
        the count goes backwards or exceeds the request's tokens or its blocks' slots.
        """
        state = self._get(request_id)
        computed = check_count(num_computed_tokens, "num_computed_tokens")
        if computed < state.computed:
            raise TokenCountError(
                f"request {request_id!r} has {state.computed} computed tokens; "
                f"the count cannot go back to {computed}"
            )
        limit = min(state.num_tokens, state.num_blocks * self._block_size)
        if computed > limit:
            raise TokenCountError(
                f"request {request_id!r} has {state.num_tokens} tokens in "
                f"{state.num_blocks} blocks; cannot mark {computed} computed"
            )
        self._advance(state, computed)

    # ---------------------------------------------------------------- queries

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._requests))

    def num_blocks(self, request_id: object) -> int:
        """Blocks in the request's table. Raises `UnknownRequestError`."""
        return self._get(request_id).num_blocks

    def block_table(self, request_id: object) -> list[BlockId]:
        """A copy of the request's block ids, root first. Raises `UnknownRequestError`."""
        return cast("list[BlockId]", expand(self._get(request_id).table))

    def num_tokens(self, request_id: object) -> int:
        """Tokens the request has (prompt plus appended). Raises `UnknownRequestError`."""
        return self._get(request_id).num_tokens

    def num_computed_tokens(self, request_id: object) -> int:
        """The request's computed-token count. Raises `UnknownRequestError`."""
        return self._get(request_id).computed

    def block_hashes(self, request_id: object) -> list[int]:
        """Sequence hashes of the request's full blocks ([] with prefix caching off)."""
        return list(self._get(request_id).hashes)

    def stats(self) -> ManagerStats:
        """The counters so far, as a frozen record."""
        return ManagerStats(
            num_requests=len(self._requests),
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            evictions=self._pool.evictions,
            preemptions=self._preemptions,
            kv_events=self._num_events,
        )

    def check_invariants(self) -> None:
        """Re-derive the request-level invariants and the pool's own; raise
        `InvariantViolationError` on any breach (a bug, never a caller's mistake).

        Per request: the computed count fits its tokens and blocks; with prefix caching,
        the watermark is ``computed // block_size`` and every visible block's hash is
        resident. Overall: the tables hold no more references than the pool
        counts (other users of the pool may hold more).
        """
        self._pool.check_invariants()
        bs = self._block_size
        hit = self._pool.prefix_hit
        total = 0
        for request_id, state in self._requests.items():
            total += state.num_blocks
            where = f"request {request_id!r}"
            table = expand(state.table)
            _require(len(table) == state.num_blocks, f"{where} miscounts its blocks")
            _require(len(set(table)) == len(table), f"{where} repeats a block")
            _require(
                state.computed <= min(state.num_tokens, state.num_blocks * bs),
                f"{where} computed more tokens than it has or holds slots for",
            )
            if not self._caching:
                _require(state.visible == 0, f"{where} has visible blocks without caching")
                continue
            _require(state.visible == state.computed // bs, f"{where} watermark is stale")
            _require(
                state.num_hashed == state.num_tokens // bs
                and len(state.hashes) == state.num_hashed,
                f"{where} hashes do not match its full blocks",
            )
            # Resident, but not necessarily active: prefix_hit reports the hash's first
            # copy, which may be an idle duplicate of the copy this request holds.
            for block_hash in state.hashes[: state.visible]:
                _require(
                    hit(block_hash) is not None,
                    f"{where} visible block {block_hash} is not resident",
                )
        _require(
            total <= self._pool.num_active_refs(),
            "the block tables hold more references than the pool counts",
        )

    # ----------------------------------------------------------------- events

    @property
    def num_pending_events(self) -> int:
        """Events queued and not yet taken."""
        return len(self._events)

    def take_events(self) -> list[KVEvent]:
        """Drain the queued events, oldest first."""
        events = self._events
        self._events = []
        return events

    def restore_events(self, events: Sequence[KVEvent]) -> None:
        """Put back events taken by `take_events` that their taker never got, ahead of
        any queued since, so the stream's order is as if they were never taken."""
        if events:
            self._events[:0] = events

    def take_batch(self, ts: object, data_parallel_rank: object = None) -> KVEventBatch | None:
        """Drain the queued events into one `KVEventBatch`, or None if there are none.

        ``ts`` must be a finite float (an int is taken) and ``data_parallel_rank`` None or
        an int >= 0; both are checked before the events are taken, so a refused call
        (`InvalidArgumentError`) loses no event.
        """
        stamp = check_timestamp(ts)
        rank = data_parallel_rank
        if rank is not None:
            rank = check_count(rank, "data_parallel_rank")
        if not self._events:
            return None
        return KVEventBatch(ts=stamp, events=self.take_events(), data_parallel_rank=rank)

    # ------------------------------------------------------------------ steps

    def finish_step(self, updates: Sequence[StepUpdate], probe: object = None) -> StepOutcome:
        """Apply a scheduler step's updates in order (append, mark computed, free), then
        drain the events and read the occupancy and counters: one call per step. With
        ``probe``, the outcome also carries that request's `prefill_cost` after the
        updates (``cost``): the cost of the queue's head as the next step starts.

        Raises `UnknownRequestError` or `InvalidArgumentError`, changing nothing, for an
        update naming an unknown request or carrying bad tokens, or an unknown probe or
        one the updates free. An update refused half way (a computed count going
        backwards, say) is the scheduler's bug, not a refusal: it raises
        `InvariantViolationError`, which crashes an actor.
        """
        self._check_updates(updates, probe)
        self._apply_updates(updates)
        return self._step_outcome(probe)

    def finish_stretch(
        self, stretch: object, updates: Sequence[StepUpdate]
    ) -> tuple[StretchAllocations, StepOutcome]:
        """`allocate_stretch` of ``stretch`` (no probe), then `finish_step` of
        ``updates`` (no probe), in one call: a fast-forward jump whose last step
        finishes requests, its allocations and their frees. The updates are applied
        whatever the stretch did, as they would be by the two calls one after the
        other; both arguments are checked before anything changes (a stretch neither
        registers nor forgets a request, so the updates' checks hold after it), and
        each raises what its own call raises."""
        self._check_updates(updates, None)
        allocations = self.allocate_stretch(stretch)
        self._apply_updates(updates)
        return allocations, self._step_outcome(None)

    def _check_updates(self, updates: Sequence[StepUpdate], probe: object) -> None:
        """`finish_step`'s checks of its arguments (what it raises, before any change)."""
        for update in updates:
            if type(update) is not StepUpdate:
                raise InvalidArgumentError(f"expected a StepUpdate, got {update!r:.200}")
            raw: Any = update  # read untyped: a typed read of a bad field raises a bare TypeError
            self._get(raw.request_id)
            if type(raw.append) is not list or type(raw.computed) is not int:
                raise InvalidArgumentError(
                    f"a StepUpdate's append must be a list and computed an int, got {update!r:.200}"
                )
            if type(raw.free) is not bool:
                raise InvalidArgumentError(
                    f"a StepUpdate's free must be a bool, got {update!r:.200}"
                )
            if raw.append:
                check_tokens(raw.append)
            if raw.free and raw.request_id == probe:
                raise InvalidArgumentError(f"the probe {probe!r} is freed by the step's updates")
        if probe is not None:
            self._get(probe)

    def _step_outcome(self, probe: object) -> StepOutcome:
        """After a step's updates: the drained events, the occupancy, the counters and
        the checked ``probe``'s cost (`finish_step`)."""
        pool = self._pool
        usage = PoolUsage(pool.num_active(), pool.num_inactive(), pool.capacity)
        cost = None if probe is None else self.prefill_cost(probe)
        return StepOutcome(self.take_events(), usage, self.stats(), cost)

    def _apply_updates(self, updates: Sequence[StepUpdate]) -> None:
        """Apply checked step updates in order (`finish_step`)."""
        try:
            for update in updates:
                request_id = update.request_id
                if update.append:
                    self.append_tokens(request_id, update.append)
                if update.computed >= 0:
                    self.mark_computed(request_id, update.computed)
                if update.free:
                    self.free(request_id)
        except PoolError as exc:
            raise InvariantViolationError(f"a step's updates failed half way: {exc}") from exc

    # -------------------------------------------------------------- internals

    def _get(self, request_id: object) -> RequestState:
        if type(request_id) is str:
            state = self._requests.get(request_id)
            if state is not None:
                return state
        check_request_id(request_id)
        raise UnknownRequestError(
            f"request {request_id!r} is not registered (never added, or already freed)"
        )

    def _prefix_limit(self, state: RequestState) -> int:
        """At most this many leading blocks are reused: the last token is always computed."""
        return (state.num_tokens - 1) // self._block_size

    def _advance(
        self,
        state: RequestState,
        computed: int,
        fresh: int = -1,
        stored: list[int] = _NO_RUNS,
        stored_count: int = 0,
    ) -> None:
        """Raise the computed count to ``computed`` (checked by the caller: it fits the
        tokens and the table) and cache the full blocks it newly covers; the table's
        ``stored_count`` blocks from ``fresh`` on (an allocation's) were cached by the
        pool already, ``stored`` the positions among them of their hashes' first copies
        (runs: `BlockPool.admit_runs`)."""
        if computed <= state.computed:
            return
        state.computed = computed
        if not self._caching:
            return
        full = computed // self._block_size
        if full > state.visible:
            stop = fresh if stored_count else full
            self._promote(state, state.visible, stop, stored, stored_count)
            state.visible = full

    def _promote(
        self,
        state: RequestState,
        start: int,
        stop: int,
        stored: list[int] = _NO_RUNS,
        stored_count: int = 0,
    ) -> None:
        """Cache table blocks ``[start, stop)``, and queue Stored events for new hashes
        there and among the ``stored_count`` blocks after them (cached already; ``stored``
        the positions among them of first copies, as runs): one event per run of blocks
        whose hash had no resident copy."""
        table = state.table
        chain = state.chain
        if stop - start == 1 and not stored_count:  # a decode step filling its block
            block_id = run_at(table, start, state.num_blocks)
            if self._pool.cache_private(BlockId(block_id), run_at(chain, start, state.num_hashed)):
                self._stored(state, start, stop)
            return
        firsts: list[int] = []  # positions from ``start`` of the first copies, as runs
        if stop > start:
            firsts = self._pool.cache_runs(
                slice_runs(table, start, stop), slice_runs(chain, start, stop)
            )
        for r in range(0, len(stored), 2):
            add_run(firsts, stored[r] + stop - start, stored[r + 1])
        if not self._record_events:  # no event to build: each run is one, counted
            self._num_events += len(firsts) // 2
            return
        for r in range(0, len(firsts), 2):
            self._stored(state, start + firsts[r], start + firsts[r] + firsts[r + 1])

    def _stored(self, state: RequestState, start: int, stop: int) -> None:
        self._num_events += 1
        if not self._record_events:
            return
        bs = self._block_size
        hashes = state.hashes
        self._events.append(
            BlockStored(
                block_hashes=hashes[start:stop],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=state.tokens[start * bs : stop * bs].tolist(),
                block_size=bs,
                lora_id=None,
                medium=self._medium,
            )
        )

    def _release_table(self, state: RequestState) -> None:
        """Release every block leaf first, so a leaf enters the LRU before its parent;
        all or nothing (the pool checks every id before it releases one)."""
        self._pool.release_runs(state.table)
        state.reset()


class _SlotWalk:
    """A chain's slots walked in order, segment by segment (`KvManager._chain_at_once`):
    each request's table length, computed count and watermark moving as
    `KvManager._run_at_once`'s walk moves them, each segment's event counts per group,
    and the blocks each request's table grows by in it (``grown``, for the requests
    ``touched``: only those, so a segment costs its slots, not the batch).

    Each request's slots come back every block_size steps, at one or two residues: its
    entries, ``(residue * n + request) * 2`` (``+ 1`` for the fills' when they differ),
    sorted once, list a period's slots in the chain's order; ``starts[r]`` is the first
    entry at residue ``r`` or after, where a segment starting mid-period begins."""

    def __init__(
        self,
        run: DecodeRun,
        states: list[RequestState],
        highs: list[int],
        block_size: int,
        caching: bool,
    ) -> None:
        self.targets = run.targets
        self.grows = run.grows
        self.fills = run.fills
        self.highs = highs
        self.block_size = block_size
        self.caching = caching
        n = len(highs)
        # Each request's moving counts, unboxed (`librt.vecs`): the walk writes one or
        # more of them at each of a chain's slots (255,000 on the multi-turn trace), and
        # a `list[int]` boxes every write; this walk then runs 38% fewer instructions.
        self.lengths = vec[i64]([state.num_blocks for state in states])
        self.done = vec[i64]([state.computed for state in states])
        self.seen = vec[i64]([state.visible for state in states])
        self.grown = vec[i64]([0] * n)
        self.touched: list[int] = []
        entries: list[int] = []
        for i in range(n):
            grow = self.grows[i]
            fill = self.fills[i]
            if grow >= 0:
                entries.append((grow % block_size * n + i) * 2)
            if fill >= 0 and (grow < 0 or fill % block_size != grow % block_size):
                entries.append((fill % block_size * n + i) * 2 + 1)
        entries.sort()
        self.entries = entries
        starts = [len(entries)] * (block_size + 1)
        for k in range(len(entries) - 1, -1, -1):
            starts[entries[k] // (2 * n)] = k
        for r in range(block_size - 1, -1, -1):
            starts[r] = min(starts[r], starts[r + 1])
        self.starts = starts

    def segment(self, low: int, high: int, room: int, events: int, kv_events: list[int]) -> int:
        """Walk the slots of steps ``low`` to ``high`` (a segment with ``room`` blocks
        unallocated before its admissions): append each group's event count after it
        to ``kv_events`` and return the count after the last. A slot counts a Stored
        event if it makes a block visible, a growth a Removed one once the segment's
        growths outgrow ``room``."""
        bs = self.block_size
        caching = self.caching
        entries = self.entries
        targets = self.targets
        grows = self.grows
        fills = self.fills
        highs = self.highs
        lengths = self.lengths
        done = self.done
        seen = self.seen
        grown = self.grown
        touched = self.touched
        n = len(highs)
        size = len(entries)
        used = 0
        group = -1
        base = low - low % bs
        k = self.starts[low % bs]
        while base <= high:
            while k < size:
                key = entries[k]
                k += 1
                i = key // 2 % n
                step = base + key // (2 * n)
                if step > high:
                    break
                if step < low or step > highs[i]:
                    continue
                first = fills[i] if key & 1 else grows[i]
                if step < first:
                    # its other progression may reach this residue first (both at one
                    # residue: one entry, the growths')
                    other = grows[i] if key & 1 else fills[i]
                    if key & 1 or other < 0 or other % bs != first % bs or step < other:
                        continue
                if step != group:
                    if group >= 0:
                        kv_events.append(events)
                    group = step
                now = targets[i] + step
                need = -(-now // bs)
                if need > lengths[i]:
                    if not grown[i]:
                        touched.append(i)
                    grown[i] += need - lengths[i]
                    used += need - lengths[i]
                    lengths[i] = need
                    if used > room:
                        events += 1
                if now > done[i]:  # `_advance`
                    done[i] = now
                    if caching and now // bs > seen[i]:
                        seen[i] = now // bs
                        events += 1
            base += bs
            k = 0
        if group >= 0:
            kv_events.append(events)
        return events

    def clear(self) -> None:
        """Forget the last segment's growths."""
        for i in self.touched:
            self.grown[i] = 0
        self.touched = []


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolationError(message)


__all__ = ["KvManager"]
