"""The mock engine's scheduling rules, each pinned by a small scenario on a real pool."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

from kvpool.engine import (
    EngineConfig,
    LocalKvClient,
    MockEngine,
    StepResult,
    TimedKvClient,
)
from kvpool.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolationError,
    UnknownRequestError,
)
from kvpool.events import BlockRemoved, BlockStored, EventCollector
from kvpool.manager import (
    AdmissionGate,
    DecodeRun,
    KvManager,
    PrefillCost,
    QueuedRequest,
    RunAllocations,
    SlotRequest,
    StepAllocations,
    StepSchedule,
    StepUpdate,
)
from kvpool.pool import BlockPool
from kvpool.workloads import RequestSpec, Segment, SyntheticWorkload, mix_seed

pytestmark = pytest.mark.anyio


def spec(name: str, prompt: int, output: int, *, arrival: float = 0.0) -> RequestSpec:
    """A request whose prompt and output tokens are unique to ``name``."""
    seed = mix_seed(*name.encode())
    return RequestSpec(name, arrival, (Segment(seed, prompt),), Segment(mix_seed(seed, 1), output))


def make_engine(**overrides: object) -> tuple[MockEngine, LocalKvClient]:
    config = EngineConfig(**overrides)  # type: ignore[arg-type]
    kv = LocalKvClient.create(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    return MockEngine(kv, config), kv


async def run_steps(engine: MockEngine) -> list[StepResult]:
    steps = []
    while engine.has_work:
        steps.append(await engine.step())
    return steps


def assert_clean(kv: LocalKvClient) -> None:
    """No request left in the manager, no block in use, the pool consistent."""
    pool = kv.manager.pool
    assert len(kv.manager) == 0
    assert pool.num_active() == 0
    assert pool.num_active_refs() == 0
    pool.check_invariants()


async def test_each_step_stays_within_the_token_budget() -> None:
    engine, kv = make_engine(max_num_batched_tokens=64, num_gpu_blocks=256)
    for i in range(12):
        await engine.submit(spec(f"r{i}", 50 + 7 * i, 20))
    steps = await run_steps(engine)
    totals = [sum(step.scheduled.values()) for step in steps]
    assert max(totals) == 64  # the budget is used up when work is queued
    assert all(0 < total <= 64 for total in totals)
    assert engine.stats.completed == 12
    assert_clean(kv)


async def test_running_requests_never_exceed_max_num_seqs() -> None:
    engine, kv = make_engine(max_num_seqs=3, num_gpu_blocks=256)
    for i in range(10):
        await engine.submit(spec(f"r{i}", 20, 15))
    steps = await run_steps(engine)
    assert max(len(step.scheduled) for step in steps) == 3
    assert engine.stats.completed == 10
    assert_clean(kv)


async def test_running_requests_are_served_before_waiting_ones() -> None:
    engine, _ = make_engine(max_num_batched_tokens=32, num_gpu_blocks=256)
    await engine.submit(spec("old", 8, 10))
    await engine.step()  # "old" prefilled; it decodes from now on
    await engine.submit(spec("new", 200, 5))
    step = await engine.step()
    assert list(step.scheduled) == ["old", "new"]
    assert step.scheduled == {"old": 1, "new": 31}


async def test_chunked_prefill_splits_a_long_prompt_across_steps() -> None:
    engine, kv = make_engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    await engine.submit(spec("long", 150, 3))
    steps = await run_steps(engine)
    assert [step.scheduled["long"] for step in steps] == [64, 64, 22, 1, 1]
    assert_clean(kv)


async def test_without_chunked_prefill_a_prompt_runs_whole_or_waits() -> None:
    engine, kv = make_engine(
        max_num_batched_tokens=64, enable_chunked_prefill=False, enable_prefix_caching=False
    )
    await engine.submit(spec("decoder", 10, 30))
    await engine.step()  # prefilled: decodes one token per step from now on
    await engine.submit(spec("whole", 64, 1))  # 64 tokens: never fits beside a decode
    await engine.submit(spec("behind", 5, 2))  # first come first served: waits too
    steps = await run_steps(engine)
    first: dict[str, tuple[int, int]] = {}
    for index, step in enumerate(steps):
        for request_id, tokens in step.scheduled.items():
            first.setdefault(request_id, (index, tokens))
    decoder_done = next(i for i, step in enumerate(steps) if "decoder" in step.finished)
    assert first["whole"] == (decoder_done + 1, 64)  # the whole prompt, once alone
    # "behind" would fit beside the decoder, but waits behind "whole" (FCFS), then for
    # the budget "whole" used up
    assert first["behind"] == (decoder_done + 2, 5)
    assert all(sum(step.scheduled.values()) <= 64 for step in steps)
    assert_clean(kv)


async def test_without_chunked_prefill_a_request_longer_than_a_step_is_rejected() -> None:
    engine, kv = make_engine(max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert await engine.submit(spec("fits", 60, 5))  # 60 + 5 - 1 = 64 tokens computed
    assert not await engine.submit(spec("too-long", 60, 6))
    assert engine.rejected_ids == ["too-long"]
    assert "too-long" not in kv.manager
    await run_steps(engine)
    assert (engine.stats.completed, engine.stats.rejected) == (1, 1)


async def test_a_request_larger_than_the_pool_is_rejected_and_never_allocated() -> None:
    engine, kv = make_engine(num_gpu_blocks=4, block_size=4)
    # prompt + output - 1 tokens need KV slots: 13 + 4 - 1 = 16 fit in 4 blocks of 4
    assert await engine.submit(spec("fits", 13, 4))
    assert not await engine.submit(spec("too-big", 13, 5))
    assert "too-big" not in kv.manager
    await run_steps(engine)
    stats = engine.stats
    assert (stats.submitted, stats.completed, stats.rejected) == (2, 1, 1)
    assert_clean(kv)


async def three_requests_filling_the_pool(mode: str) -> tuple[MockEngine, list[StepResult]]:
    """A, B, C each hold 2 of the 6 blocks; the next block any of them needs is missing."""
    engine, _ = make_engine(num_gpu_blocks=6, block_size=4, preemption_mode=mode)
    for name in ("A", "B", "C"):
        await engine.submit(spec(name, 7, 10))
    steps = [await engine.step(), await engine.step()]  # prefill 7, decode the 8th
    assert engine.running
    assert [r.num_blocks for r in engine.running] == [2, 2, 2]
    steps.append(await engine.step())  # the 9th token needs a 3rd block each
    return engine, steps


async def test_lifo_preempts_the_newest_running_request() -> None:
    engine, steps = await three_requests_filling_the_pool("lifo")
    assert steps[-1].preempted == ["C"]
    assert list(steps[-1].scheduled) == ["A", "B"]
    victim = engine.waiting[0]
    assert (victim.request_id, victim.num_computed, victim.num_blocks) == ("C", 0, 0)
    assert [r.request_id for r in engine.running] == ["A", "B"]


async def test_fifo_preempts_the_oldest_running_request() -> None:
    engine, steps = await three_requests_filling_the_pool("fifo")
    assert steps[-1].preempted == ["A"]
    # B preempted A, ahead of it in the running list: the loop steps back, so C is
    # still tried in this step (vLLM's; Dynamo's mocker skips C for the step)
    assert list(steps[-1].scheduled) == ["B", "C"]
    assert engine.waiting[0].request_id == "A"


async def test_a_preempted_request_goes_to_the_front_of_the_queue_and_finishes() -> None:
    engine, steps = await three_requests_filling_the_pool("lifo")
    await engine.submit(spec("D", 3, 2))
    assert [r.request_id for r in engine.waiting] == ["C", "D"]
    steps += await run_steps(engine)
    admitted = [rid for step in steps[3:] for rid in step.scheduled if rid in ("C", "D")]
    assert admitted[0] == "C"
    assert engine.stats.completed == 4
    assert engine.stats.preemptions == sum(len(step.preempted) for step in steps) >= 1


async def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    engine, _ = make_engine(num_gpu_blocks=6, block_size=4)
    for name in ("A", "B", "C", "D"):
        await engine.submit(spec(name, 7, 10))
    preempting = 0
    while engine.has_work:
        running_before = {request.request_id for request in engine.running}
        step = await engine.step()
        if step.preempted:
            preempting += 1
            assert set(step.scheduled) <= running_before
    assert preempting > 0
    assert engine.stats.completed == 4


async def test_decode_grows_the_block_table_one_block_at_a_time() -> None:
    engine, kv = make_engine(block_size=4, num_gpu_blocks=64)
    await engine.submit(spec("r", 5, 20))
    request = engine.waiting[0]
    seen = []
    while engine.has_work:
        await engine.step()
        if request.finish_s is None:
            seen.append(request.num_blocks)
            assert request.num_blocks == math.ceil(request.num_computed / 4)
            assert kv.manager.num_blocks("r") == request.num_blocks
    assert seen == sorted(seen)
    assert seen[-1] == math.ceil((5 + 20 - 1) / 4)
    assert all(b - a <= 1 for a, b in itertools.pairwise(seen))


async def test_blocks_become_visible_in_the_step_that_schedules_them() -> None:
    collector = EventCollector()
    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=8)
    kv = LocalKvClient.create(64, 4)
    engine = MockEngine(kv, config, rank=3, sink=collector, epoch=1000.0)
    await engine.submit(spec("r", 18, 3))
    stored_per_step = []
    while engine.has_work:
        before = len(collector.batches)
        await engine.step()
        new = collector.batches[before:]
        assert len(new) <= 1  # one batch per step at most
        stored_per_step.append(
            sum(len(e.block_hashes) for b in new for e in b.events if isinstance(e, BlockStored))
        )
    # 8 + 8 + 2 prompt tokens, then decode: the 5th block fills with the 20th token,
    # scheduled in the 5th step; each step's batch holds what that step scheduled full
    assert stored_per_step == [2, 2, 0, 0, 1]
    assert all(b.data_parallel_rank == 3 for b in collector.batches)
    assert [b.ts for b in collector.batches] == sorted(b.ts for b in collector.batches)
    assert collector.batches[0].ts > 1000.0


def test_an_event_sink_needs_kv_cache_events() -> None:
    config = EngineConfig(block_size=4, num_gpu_blocks=64, enable_kv_cache_events=False)
    kv = LocalKvClient.create(64, 4, enable_kv_cache_events=False)
    with pytest.raises(InvalidArgumentError, match="enable_kv_cache_events"):
        MockEngine(kv, config, sink=EventCollector())
    with pytest.raises(InvalidArgumentError, match="enable_kv_cache_events must be a bool"):
        EngineConfig(enable_kv_cache_events=1)  # type: ignore[arg-type]


async def test_event_stream_is_a_valid_router_history_under_pressure() -> None:
    collector = EventCollector()
    config = EngineConfig(num_gpu_blocks=192, block_size=16, max_num_batched_tokens=512)
    kv = LocalKvClient.create(192, 16)
    engine = MockEngine(kv, config, sink=collector)
    for request in SyntheticWorkload(seed=3, num_sessions=12).requests():
        await engine.submit(request)
    await run_steps(engine)
    assert engine.stats.evictions > 0
    assert engine.stats.preemptions > 0
    resident: set[int] = set()
    for batch in collector.batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                assert parent is None or parent in resident  # parent stored before child
                for block_hash in event.block_hashes:
                    assert block_hash not in resident  # never stored twice while resident
                    resident.add(block_hash)
                assert len(event.token_ids) == 16 * len(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert set(event.block_hashes) <= resident  # removed only if stored
                resident -= set(event.block_hashes)
    assert engine.stats.event_batches == len(collector.batches) <= engine.stats.steps


async def test_an_idle_engine_reads_zero_usage_and_leaks_nothing() -> None:
    engine, kv = make_engine(num_gpu_blocks=128, max_num_batched_tokens=256)
    for request in SyntheticWorkload(seed=1, num_sessions=10).requests():
        await engine.submit(request)
    await run_steps(engine)
    usage = await engine.final_usage()
    assert usage.num_active == 0
    assert usage.fraction == 0.0
    assert usage.num_inactive > 0  # the cache is kept, just not in use
    assert engine.stats.usage[-1] == 0.0
    assert max(engine.stats.usage) > 0.5
    assert_clean(kv)


async def test_engine_counters_agree_with_the_manager() -> None:
    engine, kv = make_engine(num_gpu_blocks=160, max_num_batched_tokens=512)
    requests = SyntheticWorkload(seed=2, num_sessions=15).requests()
    for request in requests:
        await engine.submit(request)
    await run_steps(engine)
    stats, manager = engine.stats, kv.manager.stats()
    assert stats.preemptions == manager.preemptions > 0
    assert stats.evictions == manager.evictions > 0
    assert stats.prefix_query_tokens == manager.prefix_query_tokens
    assert stats.prefix_hit_tokens == manager.prefix_hit_tokens > 0
    served = [r for r in requests if r.request_id not in engine.rejected_ids]
    assert stats.completed + stats.rejected == stats.submitted == len(requests)
    assert stats.generated_tokens == sum(r.output_length for r in served)
    assert stats.prompt_tokens == sum(r.input_length for r in served)
    assert_clean(kv)


async def test_prefix_caching_off_reuses_nothing() -> None:
    engine, kv = make_engine(num_gpu_blocks=256, enable_prefix_caching=False)
    for request in SyntheticWorkload(seed=4, num_sessions=5).requests():
        await engine.submit(request)
    await run_steps(engine)
    assert engine.stats.prefix_hit_tokens == engine.stats.prefix_query_tokens == 0
    assert kv.manager.pool.num_inactive() == 0  # nothing was ever cached
    assert_clean(kv)


async def test_shared_prefixes_hit_the_cache() -> None:
    engine, _ = make_engine(block_size=4, num_gpu_blocks=64)
    shared = Segment(12345, 40)
    first = RequestSpec("a", 0.0, (shared, Segment(1, 3)), Segment(2, 2))
    second = RequestSpec("b", 0.0, (shared, Segment(3, 5)), Segment(4, 2))
    await engine.submit(first)
    await run_steps(engine)
    await engine.submit(second)
    await run_steps(engine)
    # b reuses the 10 full blocks of the shared 40 tokens
    assert engine.stats.prefix_hit_tokens == 40


async def test_a_mismatched_kv_client_is_refused() -> None:
    kv = LocalKvClient.create(10, 16)
    with pytest.raises(ValueError, match="10 blocks of 16"):
        MockEngine(kv, EngineConfig(num_gpu_blocks=11, block_size=16))


class CheckedEngine(MockEngine):
    """Checks, at every admission check (its gate's inputs read), its count of active
    blocks against the pool."""

    checks = 0

    def _gate(self, budget: int, growing: int = 0) -> AdmissionGate:
        assert isinstance(self.kv, LocalKvClient)
        assert self.num_active_blocks == self.kv.manager.pool.num_active()
        self.checks += 1
        return super()._gate(budget, growing)


async def test_the_engine_tracks_active_blocks_exactly_within_a_step() -> None:
    config = EngineConfig(num_gpu_blocks=200, max_num_batched_tokens=1024)
    engine = CheckedEngine(LocalKvClient(KvManager(BlockPool(200), 16)), config)
    for request in SyntheticWorkload(seed=6, num_sessions=20).requests():
        await engine.submit(request)
    await run_steps(engine)
    assert engine.checks > engine.stats.completed  # blocked heads were re-checked too
    assert engine.stats.preemptions > 0


async def test_a_step_update_for_an_unknown_request_changes_nothing() -> None:
    kv = LocalKvClient.create(16, 4)
    await kv.add_request("r", list(range(10)))
    assert await kv.allocate("r", 10) is not None
    before = await kv.usage()
    with pytest.raises(UnknownRequestError, match="ghost"):
        await kv.finish_step([StepUpdate("r", [], 8, True), StepUpdate("ghost", [], -1, True)])
    assert await kv.usage() == before
    assert "r" in kv.manager
    assert kv.manager.num_computed_tokens("r") == 0
    assert await kv.take_events() == []


async def test_a_fifo_victim_already_scheduled_gives_its_tokens_back() -> None:
    engine, _ = make_engine(
        num_gpu_blocks=6, block_size=4, preemption_mode="fifo", max_num_batched_tokens=64
    )
    for name, prompt in (("A", 6), ("B", 6), ("C", 7)):
        await engine.submit(spec(name, prompt, 10))
    await engine.step()  # prefill: 2 blocks each, the pool is full
    await engine.step()  # A and B reach 8 tokens, C 9: only C needs a third block
    step = await engine.step()
    # A was scheduled first, then chosen as the (oldest) victim when C did not fit
    assert step.preempted == ["A"]
    assert step.scheduled == {"B": 1, "C": 1}
    assert [r.request_id for r in engine.running] == ["B", "C"]
    assert engine.waiting[0].request_id == "A"


async def test_the_local_client_checks_the_managers_invariants_not_only_the_pools() -> None:
    kv = LocalKvClient.create(8, 4)
    await kv.add_request("r", list(range(10)))
    await kv.allocate("r", 10)
    await kv.mark_computed("r", 10)
    await kv.check_invariants()
    kv.manager._requests["r"].visible = 1  # corrupt on purpose: two blocks are visible
    with pytest.raises(InvariantViolationError, match="watermark"):
        await kv.check_invariants()


async def test_event_batches_are_counted_with_or_without_a_sink() -> None:
    async def run(sink: EventCollector | None) -> MockEngine:
        config = EngineConfig(num_gpu_blocks=192, max_num_batched_tokens=512)
        engine = MockEngine(LocalKvClient.create(192, 16), config, sink=sink)
        for request in SyntheticWorkload(seed=3, num_sessions=6).requests():
            await engine.submit(request)
        await run_steps(engine)
        return engine

    collector = EventCollector()
    published = await run(collector)
    unobserved = await run(None)
    # the report's "KV event batches" is what the engine produced, not whether anyone
    # listened: 0 without a sink read as "the cache changed nothing a router could see"
    assert len(collector.batches) > 0
    assert unobserved.stats.event_batches == published.stats.event_batches
    assert published.stats.event_batches == len(collector.batches)


async def test_the_timed_client_delegates_and_counts_every_call() -> None:
    inner = LocalKvClient.create(16, 4)
    kv = TimedKvClient(inner)
    assert (kv.block_size, kv.capacity) == (4, 16)
    await kv.add_request("r", list(range(6)))
    allocation = await kv.allocate("r", 6)
    assert allocation is not None
    assert len(allocation.block_ids) == 2
    with pytest.raises(UnknownRequestError):
        await kv.free("nope")  # a failed call is timed and counted too
    outcome = await kv.finish_step([StepUpdate("r", [], 6, True)])
    assert outcome.usage.num_active == 0
    assert kv.calls == 4
    assert kv.seconds > 0


async def test_abort_frees_a_running_and_a_waiting_request_and_leaks_nothing() -> None:
    engine, kv = make_engine(num_gpu_blocks=64, block_size=4, max_num_seqs=1)
    await engine.submit(spec("running", 12, 50))
    await engine.submit(spec("waiting", 8, 5))
    await engine.step()  # "running" holds 3 full blocks + 1; "waiting" waits (max_num_seqs)
    assert kv.manager.pool.num_active() > 0
    assert await engine.abort("running")
    assert await engine.abort("waiting")
    assert not await engine.abort("running")  # gone already: nothing changes
    assert not engine.has_work
    assert engine.stats.aborted == 2
    assert_clean(kv)
    # its cached blocks stay findable, idle in the LRU (freed leaf first by the manager)
    assert kv.manager.pool.num_inactive() == 3


async def test_a_request_reaches_the_manager_with_its_first_admission_not_its_arrival() -> None:
    """Queuing costs no KV call; the first admission registers the request (one call),
    and a request aborted before it never reaches the manager."""
    inner = LocalKvClient.create(64, 4)
    kv = TimedKvClient(inner)
    engine = MockEngine(kv, EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=1))
    for name in ("a", "b", "c"):
        assert await engine.submit(spec(name, 6, 3))
    assert kv.calls == 0
    assert len(inner.manager) == 0
    await engine.step()  # admits a (max_num_seqs=1): b and c stay unknown to the manager
    assert list(inner.manager) == ["a"]
    calls = kv.calls
    assert await engine.abort("c")  # no call: the manager never heard of it
    assert await engine.submit(spec("d", 6, 3))
    assert kv.calls == calls
    assert engine.stats.aborted == 1
    await run_steps(engine)
    assert engine.stats.completed == 3
    assert_clean(inner)


async def test_a_duplicate_request_id_is_refused_and_changes_nothing() -> None:
    engine, kv = make_engine(num_gpu_blocks=64, block_size=4, max_num_seqs=1)
    await engine.submit(spec("a", 6, 3))
    await engine.submit(spec("b", 6, 3))
    await engine.step()  # a runs (registered), b waits (not yet)
    for name in ("a", "b"):
        with pytest.raises(DuplicateRequestError):
            await engine.submit(spec(name, 9, 2))
    assert engine.stats.submitted == 2
    assert [r.request_id for r in engine.running] == ["a"]
    assert [r.request_id for r in engine.waiting] == ["b"]
    await run_steps(engine)
    assert engine.stats.completed == 2
    assert await engine.submit(spec("a", 6, 3))  # finished: its id is free again
    await run_steps(engine)
    assert_clean(kv)


class CountingKv(LocalKvClient):
    """Records the engine's allocation and admission-cost calls."""

    def __init__(self, manager: KvManager) -> None:
        super().__init__(manager)
        self.slots: list[list[str]] = []  # each step's request ids, each call's
        self.costs = 0
        self.registered = 0  # admissions that registered their request

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        self.slots.extend([slot.request_id for slot in slots] for slots in steps)
        return await super().allocate_steps(steps, probe, stop_if_cost_changes=stop_if_cost_changes)

    async def allocate_run(
        self,
        run: DecodeRun,
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> RunAllocations:
        self.slots.extend(
            [slot.request_id for slot in slots] for slots in run.stretch(self.block_size).steps()
        )
        return await super().allocate_run(run, probe, stop_if_cost_changes=stop_if_cost_changes)

    async def schedule(
        self,
        slots: list[SlotRequest],
        queue: list[QueuedRequest],
        gate: AdmissionGate,
        run: DecodeRun | None = None,
    ) -> StepSchedule:
        """Recorded as a carried run's steps, then the slots that fit, then the requests
        admitted."""
        if run is not None:
            self.slots.extend(
                [slot.request_id for slot in step] for step in run.stretch(self.block_size).steps()
            )
        schedule = await super().schedule(slots, queue, gate, run)
        fit = len(schedule.step.allocations) - len(schedule.costs)
        admitted = queue[: len(schedule.costs)]
        self.slots.append([s.request_id for s in slots[:fit]] + [q.request_id for q in admitted])
        self.registered += sum(q.prompt_token_ids is not None for q in admitted)
        return schedule

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        self.costs += 1
        return await super().prefill_cost(request_id)


async def test_a_steps_allocations_and_admission_costs_share_calls() -> None:
    """A step's KV work is one call (more only while a queue's requests all get in):
    the running requests that need blocks, then the admissions, each new request
    registered by the call that admits it: no prefill_cost, and no call at an arrival."""
    config = EngineConfig(num_gpu_blocks=64, block_size=4, max_num_seqs=8)
    kv = CountingKv(KvManager(BlockPool(64), 4))
    engine = MockEngine(kv, config)
    for name in "abcd":
        await engine.submit(spec(name, 4, 6))  # one full block each
    await engine.step()
    # each new request is registered, asked and admitted by the call that hands it over:
    # one at first, then twice as many while they all get in
    assert (kv.slots, kv.costs, kv.registered) == ([["a"], ["b", "c"], ["d"]], 0, 4)
    kv.slots.clear()
    await engine.submit(spec("e", 4, 6))
    await engine.step()  # every running request's fifth token needs a second block
    assert kv.slots == [["a", "b", "c", "d", "e"]]  # and e admitted in the same call
    assert (kv.costs, kv.registered) == (0, 5)
    await run_steps(engine)
    assert engine.stats.completed == 5
    assert_clean(kv)


async def test_a_long_queue_is_handed_over_a_few_requests_at_a_time() -> None:
    """A step hands the manager one waiting request, then twice as many while all get
    in: a queue of 40 where 5 fit costs three calls of 1, 2 and 4 requests (the last
    one refused), not 40 prompts named each step."""
    config = EngineConfig(num_gpu_blocks=10, block_size=4, max_num_seqs=64)
    kv = CountingKv(KvManager(BlockPool(10), 4))
    engine = MockEngine(kv, config)
    handed: list[int] = []
    schedule = kv.schedule

    async def counted(
        slots: list[SlotRequest],
        queue: list[QueuedRequest],
        gate: AdmissionGate,
        run: DecodeRun | None = None,
    ) -> StepSchedule:
        handed.append(len(queue))
        return await schedule(slots, queue, gate, run)

    kv.schedule = counted  # type: ignore[method-assign]
    for i in range(40):
        await engine.submit(spec(f"r{i}", 6, 2))  # two blocks each: five fit in ten
    await engine.step()
    assert handed == [1, 2, 4]
    assert len(engine.running) == 5
    assert len(kv.manager) == 6  # the five admitted and the first refused
    await run_steps(engine)
    assert engine.stats.completed == 40
    assert_clean(kv)


async def test_a_refused_slot_preempts_and_the_rest_are_allocated_after() -> None:
    """When one of a step's allocations does not fit, the ones before it stand, the
    victim is preempted, and the ones after it go in a later call."""
    config = EngineConfig(num_gpu_blocks=8, block_size=4, max_num_seqs=8)
    kv = CountingKv(KvManager(BlockPool(8), 4))
    engine = MockEngine(kv, config)
    for name in "abcd":
        await engine.submit(spec(name, 7, 6))  # two blocks each: the pool is full
    await engine.step()
    await engine.step()  # the eighth token fills each second block: one call
    kv.slots.clear()
    step = await engine.step()  # each needs a third block; none is free
    assert step.preempted == ["d", "c"]
    # a did not fit (nothing was allocated); d, the newest, is preempted and a retried;
    # then b fits (d's second block) and c does not: c is the victim itself
    assert kv.slots == [["a", "b", "c", "d"], ["a"], ["b", "c"]]
    assert step.scheduled == {"a": 1, "b": 1}
    await run_steps(engine)
    assert engine.stats.completed == 4
    assert_clean(kv)
