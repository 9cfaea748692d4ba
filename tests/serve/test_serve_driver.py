"""The engine driver without HTTP: loop-agnostic (asyncio, uvloop, trio), one task owning
the engine, requests in over a memory stream, outputs back in one outbox each."""

from __future__ import annotations

import math

import anyio
import pytest

from kvpool.engine import EngineConfig
from kvpool.serve import EngineDriver, Output
from kvpool.workloads import RequestSpec, Segment

pytestmark = pytest.mark.anyio
GUARD_S = 10


def spec(request_id: str, prompt: list[int], output: int) -> RequestSpec:
    return RequestSpec(request_id, 0.0, tuple(Segment(t, 1) for t in prompt), Segment(1000, output))


async def test_outputs_arrive_one_token_per_step_with_the_cached_prefix() -> None:
    driver = EngineDriver(EngineConfig(num_gpu_blocks=64, block_size=4), speedup_ratio=0)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(driver.run)
            first = [o async for o in driver.submit(spec("a", prompt, 3))]
            second = [o async for o in driver.submit(spec("b", prompt, 3))]
            driver.close()
    assert [o.token_ids for o in first] == [[1000], [1001], [1002]]
    assert [o.finished for o in first] == [False, False, True]
    assert {o.cached_tokens for o in first} == {0}
    assert {o.cached_tokens for o in second} == {8}  # both full blocks came from the cache
    assert driver.outstanding == 0
    assert driver.leaked_blocks == 0


async def test_a_closed_output_stream_aborts_the_request_and_frees_its_blocks() -> None:
    driver = EngineDriver(EngineConfig(num_gpu_blocks=64, block_size=4), speedup_ratio=0)
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(driver.run)
            outputs = driver.submit(spec("long", list(range(20)), 40))
            got: Output = await outputs.receive()
            outputs.close()  # the listener went away: the next output aborts it
            engine = driver.engine
            assert engine is not None
            while engine.stats.aborted == 0:
                await anyio.sleep(0.001)
            assert (await engine.kv.usage()).num_active == 0
            driver.abort("long")  # already gone: nothing happens
            driver.close()
    assert got.token_ids == [1000]
    assert engine.stats.completed == 0
    assert driver.outstanding == 0
    assert driver.leaked_blocks == 0


async def test_submitting_after_close_raises_and_the_task_drains_first() -> None:
    driver = EngineDriver(EngineConfig(num_gpu_blocks=64, block_size=4), speedup_ratio=0)
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(driver.run)
            outputs = driver.submit(spec("in-flight", [1, 2, 3], 5))
            driver.close()
            with pytest.raises(anyio.ClosedResourceError):
                driver.submit(spec("late", [1], 1))
            tokens = [t for o in [o async for o in outputs] for t in o.token_ids]
    assert tokens == [1000, 1001, 1002, 1003, 1004]  # closing let it finish
    assert driver.leaked_blocks == 0


def test_a_negative_speedup_is_refused() -> None:
    with pytest.raises(ValueError, match="speedup_ratio"):
        EngineDriver(EngineConfig(), speedup_ratio=-1)


async def test_a_paced_driver_counts_every_step_by_its_lateness() -> None:
    driver = EngineDriver(EngineConfig(num_gpu_blocks=64, block_size=4), speedup_ratio=50)
    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(driver.run)
            outputs = [o async for o in driver.submit(spec("a", [1, 2, 3], 6))]
            driver.close()
    engine = driver.engine
    assert engine is not None
    assert len(outputs) == 6
    assert sum(driver.lag_counts.values()) == engine.stats.steps == 6
    assert max(driver.lag_counts) == max(0, math.ceil(driver.worst_lag_s * 1000))
