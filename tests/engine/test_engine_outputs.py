"""A step's `RequestOutput`\\ s say everything a client is sent: stepping a burst that
preempts and shares prefixes, the outputs add up to each request's tokens and record."""

from __future__ import annotations

import pytest

from kvpool.engine import EngineConfig, LocalKvClient, MockEngine
from kvpool.workloads import RequestSpec, Segment, mix_seed

pytestmark = pytest.mark.anyio


def spec(name: str, shared: int, prompt: int, output: int) -> RequestSpec:
    """``shared`` tokens common to every request, then ``prompt`` of its own."""
    seed = mix_seed(*name.encode())
    return RequestSpec(
        name,
        0.0,
        (Segment(12345, shared), Segment(seed, prompt)),
        Segment(mix_seed(seed, 1), output),
    )


@pytest.mark.parametrize("chunk", [16, 2048])
async def test_outputs_add_up_to_each_requests_tokens_and_record(chunk: int) -> None:
    config = EngineConfig(num_gpu_blocks=12, block_size=16, max_num_batched_tokens=chunk)
    kv = LocalKvClient.create(config.num_gpu_blocks, config.block_size)
    engine = MockEngine(kv, config)
    requests = [spec(f"r{i}", 32, 8 + 5 * i, 20 + 7 * i) for i in range(6)]
    for request in requests:
        assert await engine.submit(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    cached: dict[str, int] = {r.request_id: 0 for r in requests}
    reasons: dict[str, list[str | None]] = {r.request_id: [] for r in requests}
    while engine.has_work:
        result = await engine.step()
        assert [o.request_id for o in result.outputs] == list(result.scheduled)
        for out in result.outputs:
            assert out.num_computed_tokens == result.scheduled[out.request_id]
            assert len(out.new_token_ids) <= 1
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] += out.num_cached_tokens or 0
            reasons[out.request_id].append(out.finish_reason)
            assert (out.finish_reason is not None) == (out.request_id in result.finished)
    assert engine.stats.preemptions > 0  # the pool is small: the outputs survive it
    records = {r.request_id: r for r in engine.stats.requests}
    for request in requests:
        rid = request.request_id
        assert tokens[rid] == request.output.tokens()
        assert reasons[rid][-1] == "length"
        assert reasons[rid].count("length") == 1
        assert cached[rid] == records[rid].cached_tokens  # summed over admissions
    assert sum(cached.values()) > 0  # the shared prefix was reused


async def test_an_engine_without_step_outputs_steps_the_same_and_builds_none() -> None:
    config = EngineConfig(num_gpu_blocks=12, block_size=16, max_num_batched_tokens=16)
    results = []
    for with_outputs in (True, False):
        engine = MockEngine(LocalKvClient.create(12, 16), config, step_outputs=with_outputs)
        for request in [spec(f"r{i}", 32, 8, 12) for i in range(3)]:
            assert await engine.submit(request)
        steps = []
        while engine.has_work:
            result = await engine.step()
            assert bool(result.outputs) == with_outputs
            steps.append((result.clock, result.scheduled, result.preempted, result.finished))
        results.append(steps)
    assert results[0] == results[1]
