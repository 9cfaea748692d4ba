"""Same-step visibility: a request's full blocks are cache-visible from the moment it is
scheduled (vLLM v1's ``allocate_slots``), so a later request of the same step hits them.

Every engine scenario runs on both KV backends (inline manager and pool actor) and on
every anyio backend.
"""

from __future__ import annotations

from importlib import resources

import pytest

from kvpool.engine import EngineConfig, MockEngine
from kvpool.engine.runner import KvFactory, open_actor_kv, open_local_kv
from kvpool.errors import InvalidArgumentError
from kvpool.events import BlockRemoved, BlockStored, EventCollector
from kvpool.hashing import block_hashes
from kvpool.manager import KvManager
from kvpool.pool import BlockPool
from kvpool.workloads import RequestSpec, Segment, mix_seed
from kvpool.workloads.mooncake import read_mooncake_trace

pytestmark = pytest.mark.anyio

FACTORIES = [pytest.param(open_local_kv, id="local"), pytest.param(open_actor_kv, id="actor")]


@pytest.fixture(params=FACTORIES)
def kv_factory(request: pytest.FixtureRequest) -> KvFactory:
    factory: KvFactory = request.param
    return factory


def same_prompt(name: str, prompt_seed: int, prompt: int, output: int) -> RequestSpec:
    """A request with a prompt shared by every request of the same ``prompt_seed``."""
    return RequestSpec(
        name, 0.0, (Segment(prompt_seed, prompt),), Segment(mix_seed(*name.encode()), output)
    )


def stored_hashes(collector: EventCollector, batch: int) -> list[int]:
    return [
        h
        for event in collector.batches[batch].events
        if isinstance(event, BlockStored)
        for h in event.block_hashes
    ]


async def test_two_identical_prompts_share_all_but_the_last_block_in_their_first_step(
    kv_factory: KvFactory,
) -> None:
    config = EngineConfig(num_gpu_blocks=1024, block_size=16)
    collector = EventCollector()
    async with kv_factory(config, 0) as kv:
        engine = MockEngine(kv, config, sink=collector)
        for name in ("a", "b"):
            await engine.submit(same_prompt(name, 7, 1024, 4))
        first = await engine.step()
        # a computes its 1024 tokens; b reuses a's first 63 blocks, scheduled a moment
        # earlier in the same step (the cap keeps b's last token to compute), and
        # computes its last block: 1024 - 63 * 16 = 16 tokens.
        assert first.scheduled == {"a": 1024, "b": 16}
        assert engine.stats.prefix_hit_tokens == 63 * 16 == 1008
        assert engine.stats.prefill_tokens == 1024 + 16 == 1040
        # Both sampled their first token in that step: equal TTFT.
        assert list(engine.stats.ttft_s) == [first.clock, first.clock]
        # The step's batch stores a's 64 blocks once; b's copy of the 64th is a duplicate.
        prompt = same_prompt("a", 7, 1024, 4).prompt_token_ids()
        assert stored_hashes(collector, 0) == block_hashes(prompt, 16)
        await engine.run_until_idle()
        usage = await engine.final_usage()
        assert usage.num_active == 0
    assert engine.stats.completed == 2


async def test_without_chunked_prefill_the_duplicate_still_hits_in_the_same_step(
    kv_factory: KvFactory,
) -> None:
    config = EngineConfig(block_size=16, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    async with kv_factory(config, 0) as kv:
        engine = MockEngine(kv, config)
        for name in ("a", "b"):
            await engine.submit(same_prompt(name, 7, 1024, 2))
        first = await engine.step()
        assert first.scheduled == {"a": 1024, "b": 16}
        assert engine.stats.prefix_hit_tokens == 1008
        await engine.run_until_idle()


async def test_with_prefix_caching_off_nothing_is_shared_or_published(
    kv_factory: KvFactory,
) -> None:
    config = EngineConfig(block_size=16, enable_prefix_caching=False)
    collector = EventCollector()
    async with kv_factory(config, 0) as kv:
        engine = MockEngine(kv, config, sink=collector)
        for name in ("a", "b"):
            await engine.submit(same_prompt(name, 7, 1024, 2))
        first = await engine.step()
        assert first.scheduled == {"a": 1024, "b": 1024}
        await engine.run_until_idle()
    assert engine.stats.prefix_hit_tokens == 0
    assert collector.batches == []


async def test_a_fifo_victim_scheduled_earlier_in_the_step_leaves_its_blocks_cached(
    kv_factory: KvFactory,
) -> None:
    # Pool of 6 blocks of 4: A, B (6-token prompts) and C (7) take 2 blocks each. In
    # the third step A and B compute their 8th token, filling their 2nd block (cached
    # when scheduled), and C needs a third block: FIFO preempts A, already scheduled.
    config = EngineConfig(
        num_gpu_blocks=6, block_size=4, preemption_mode="fifo", max_num_batched_tokens=64
    )
    collector = EventCollector()
    prompts = {
        name: same_prompt(name, mix_seed(*name.encode()), n, 10)
        for name, n in (("A", 6), ("B", 6), ("C", 7))
    }
    async with kv_factory(config, 0) as kv:
        engine = MockEngine(kv, config, sink=collector)
        for request in prompts.values():
            await engine.submit(request)
        await engine.step()
        await engine.step()
        step = await engine.step()
        assert step.preempted == ["A"]
        assert step.scheduled == {"B": 1, "C": 1}
        # A's 2nd block became visible when A was scheduled, before it was preempted. Its
        # blocks were then released leaf first and stayed cached (vLLM's freed blocks
        # keep their hash): C's allocation evicts the LRU head, A's 2nd block, which the
        # router sees stored and then removed; A's 1st block stays resident and idle.
        events = collector.batches[-1].events
        a_first = block_hashes(prompts["A"].prompt_token_ids(), 4)[0]
        stored = {e.parent_block_hash: e.block_hashes for e in events if isinstance(e, BlockStored)}
        a_second = stored[a_first]
        assert len(stored) == 2
        assert len(a_second) == 1
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [a_second]
        stored_at = next(
            i
            for i, e in enumerate(events)
            if isinstance(e, BlockStored) and e.block_hashes == a_second
        )
        assert stored_at < events.index(removed[0])  # stored, then evicted
        usage = await kv.usage()
        assert (usage.num_active, usage.num_inactive) == (5, 1)  # B 2 + C 3; A's 1st
        await engine.run_until_idle()
        await engine.final_usage()


def burst() -> list[RequestSpec]:
    """The shipped sample trace with every request arriving at time 0."""
    trace = resources.files("kvpool.data").joinpath("sample_trace.jsonl")
    with resources.as_file(trace) as path:
        requests = read_mooncake_trace(path)
    return [RequestSpec(r.request_id, 0.0, r.prompt, r.output) for r in requests]


def expected_hits(requests: list[RequestSpec], admitted: dict[str, int]) -> tuple[int, int]:
    """Hit tokens if each request reuses every prompt block an earlier request has (the
    longest prefix of its full blocks seen before, leaving its last token to compute),
    and how many requests reuse a block first scheduled in their own step."""
    first_step: dict[int, int] = {}  # block hash -> step of the first request holding it
    total = same_step = 0
    for request in requests:
        hashes = block_hashes(request.prompt_token_ids(), 16)
        limit = (request.input_length - 1) // 16
        hit = 0
        while hit < limit and hashes[hit] in first_step:
            hit += 1
        total += hit * 16
        step = admitted[request.request_id]
        same_step += any(first_step[h] == step for h in hashes[:hit])
        for h in hashes:
            first_step.setdefault(h, step)
    return total, same_step


@pytest.mark.slow
async def test_a_burst_of_the_sample_trace_hits_every_earlier_prompt_block(
    kv_factory: KvFactory,
) -> None:
    # A pool that never evicts (the trace needs < 54k blocks) and budget 8192: admission
    # is first come first served, and a request is admitted only once every earlier
    # prompt has been scheduled whole (an earlier chunk uses up the budget first). So
    # each request must reuse the longest prefix any earlier prompt holds, even one
    # scheduled in the same step. Dynamo's mocker (ai-dynamo-runtime 1.6.1's offline
    # replay, same burst) gives 0.653, as here. (The trace shipped before, whose
    # partial blocks shared ids with full ones, gave 0.708 in both, and 0.678 here
    # before same-step visibility, when same-step duplicates missed.)
    requests = burst()
    config = EngineConfig(num_gpu_blocks=65536, block_size=16)
    async with kv_factory(config, 0) as kv:
        engine = MockEngine(kv, config)
        for request in requests:
            await engine.submit(request)
        admitted: dict[str, int] = {}
        step = 0
        while engine.has_work:
            result = await engine.step()
            for request_id in result.scheduled:
                admitted.setdefault(request_id, step)
            assert not result.preempted
            step += 1
        await engine.final_usage()
    stats = engine.stats
    assert stats.evictions == 0
    hits, same_step = expected_hits(requests, admitted)
    assert stats.prefix_hit_tokens == hits
    assert same_step > 0  # the burst really put sharing requests in one step
    assert stats.prefix_query_tokens == sum(r.input_length for r in requests)
    assert round(stats.prefix_hit_tokens / stats.prefix_query_tokens, 3) == 0.653


def test_allocate_with_cache_marks_the_allocated_tokens_computed() -> None:
    manager = KvManager(BlockPool(16), 4)
    manager.add_request("a", list(range(10)))
    allocation = manager.allocate("a", 9, cache=True)
    assert allocation is not None
    assert len(allocation.block_ids) == 3
    assert manager.num_computed_tokens("a") == 9
    events = manager.take_events()
    assert [e.block_hashes for e in events if isinstance(e, BlockStored)] == [
        block_hashes(list(range(8)), 4)
    ]
    # A table large enough: nothing allocated, but the watermark still moves.
    manager.append_tokens("a", [10, 11])
    assert manager.allocate("a", 12, cache=True) == manager.allocate("a", 12)
    assert manager.num_computed_tokens("a") == 12
    assert len(manager.take_events()) == 1
    manager.check_invariants()


def test_allocate_with_cache_reuses_a_prefix_scheduled_a_moment_before() -> None:
    manager = KvManager(BlockPool(16), 4)
    for name in ("a", "b"):
        manager.add_request(name, list(range(12)))
    assert manager.allocate("a", 12, cache=True) is not None
    assert manager.prefill_cost("b").cached_blocks == 2  # capped: b computes token 11
    allocation = manager.allocate("b", 12, cache=True)
    assert allocation is not None
    assert allocation.cached_blocks == 2
    assert manager.num_computed_tokens("b") == 12
    events = manager.take_events()
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) == 3
    manager.check_invariants()


def test_an_allocation_that_does_not_fit_caches_nothing() -> None:
    manager = KvManager(BlockPool(4), 4)
    manager.add_request("other", list(range(100, 108)))
    assert manager.allocate("other", 8) is not None  # 2 of 4 blocks taken, private
    manager.add_request("a", list(range(12)))
    assert manager.allocate("a", 12, cache=True) is None
    assert manager.num_computed_tokens("a") == 0
    assert manager.num_blocks("a") == 0
    assert manager.take_events() == []


def test_allocate_refuses_a_non_bool_cache_and_changes_nothing() -> None:
    manager = KvManager(BlockPool(4), 4)
    manager.add_request("a", list(range(8)))
    with pytest.raises(InvalidArgumentError, match="cache"):
        manager.allocate("a", 8, cache=1)  # type: ignore[arg-type]
    assert manager.num_blocks("a") == 0
    assert manager.pool.num_active() == 0
