"""Random workloads and configurations: the scheduler's rules hold at every step."""

from __future__ import annotations

import anyio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvpool.engine import EngineConfig, LocalKvClient, MockEngine
from kvpool.workloads import RequestSpec, Segment

SHARED = [Segment(1000 + i, 8 * (i + 1)) for i in range(3)]  # prefixes worth re-hitting


@st.composite
def workloads(draw: st.DrawFn) -> list[RequestSpec]:
    requests = []
    for i in range(draw(st.integers(1, 12))):
        prefix = draw(st.sampled_from([(), *[(s,) for s in SHARED]]))
        own = Segment(50_000 + 97 * i, draw(st.integers(1, 60)))
        output = Segment(90_000 + 89 * i, draw(st.integers(1, 30)))
        requests.append(RequestSpec(f"r{i}", 0.0, (*prefix, own), output))
    return requests


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    pool_tokens = draw(st.integers(64, 480))  # from tight to roomy for ~12 requests
    return EngineConfig(
        num_gpu_blocks=max(2, pool_tokens // block_size),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(8, 160)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["lifo", "fifo"])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), config=configs())
def test_random_runs_keep_every_rule(requests: list[RequestSpec], config: EngineConfig) -> None:
    kv = LocalKvClient.create(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    engine = MockEngine(kv, config)

    async def run() -> None:
        for request in requests:
            await engine.submit(request)
        steps = []
        while engine.has_work:
            running_before = {r.request_id for r in engine.running}
            known = {r.request_id: r for r in [*engine.running, *engine.waiting]}
            step = await engine.step()
            steps.append(step)
            if not config.enable_chunked_prefill:  # no step leaves a prompt half computed
                for request_id in step.scheduled:
                    state = known[request_id]
                    assert state.finish_s is not None or (
                        state.num_computed == state.num_tokens - 1
                    )
            assert 0 < sum(step.scheduled.values()) <= config.max_num_batched_tokens
            assert len(engine.running) <= config.max_num_seqs
            if step.preempted:  # nobody is admitted in a step that preempted
                assert set(step.scheduled) <= running_before
            assert len(steps) < 20_000, "the scheduler is not converging"

    anyio.run(run)
    event(f"preempted: {engine.stats.preemptions > 0}")
    event(f"rejected: {engine.stats.rejected > 0}")
    event(f"evicted: {engine.stats.evictions > 0}")
    stats = engine.stats
    served = [r for r in requests if r.request_id not in engine.rejected_ids]
    assert stats.completed == len(served)
    assert stats.completed + stats.rejected == len(requests)
    assert stats.generated_tokens == sum(r.output_length for r in served)
    for request in requests:
        blocks = -(-(request.input_length + request.output_length - 1) // config.block_size)
        too_long = (
            not config.enable_chunked_prefill
            and request.input_length + request.output_length - 1 > config.max_num_batched_tokens
        )
        assert (request.request_id in engine.rejected_ids) == (
            blocks > config.num_gpu_blocks or too_long
        )
    manager = kv.manager.stats()
    assert stats.preemptions == manager.preemptions
    assert stats.evictions == manager.evictions
    if config.enable_prefix_caching:
        assert stats.prefix_hit_tokens == manager.prefix_hit_tokens
        assert stats.prefix_query_tokens == manager.prefix_query_tokens
    assert stats.prefix_hit_tokens <= stats.prefix_query_tokens
    pool = kv.manager.pool
    assert pool.num_active() == 0
    assert len(kv.manager) == 0
    pool.check_invariants()
    assert not stats.usage or stats.usage[-1] == 0.0
