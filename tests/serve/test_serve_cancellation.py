"""The pieces that end work when a client leaves or the server stops, without HTTP,
on asyncio, uvloop and trio: the disconnect listener, a driver's `abort_all`, and the
gauges it reports after an abort with no step to follow."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from kvpool.engine import EngineConfig
from kvpool.serve import EngineDriver
from kvpool.serve.disconnect import unless_disconnected
from kvpool.serve.metrics import ServeMetrics
from kvpool.workloads import RequestSpec, Segment

pytestmark = pytest.mark.anyio
GUARD_S = 10
CONFIG = EngineConfig(num_gpu_blocks=64, block_size=4)


def spec(request_id: str, output: int) -> RequestSpec:
    return RequestSpec(request_id, 0.0, tuple(Segment(t, 1) for t in range(10)), Segment(7, output))


class Client:
    """An ASGI ``receive`` whose client disconnects when told to."""

    def __init__(self) -> None:
        self.left = anyio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}


async def test_work_that_ends_first_returns_its_result() -> None:
    client = Client()

    async def work() -> int:
        await anyio.sleep(0)
        return 42

    with anyio.fail_after(GUARD_S):
        assert await unless_disconnected(client.receive, work) == (True, 42)


async def test_a_disconnect_cancels_the_work_and_its_cleanup_runs() -> None:
    client = Client()
    cleaned = []

    async def work() -> int:
        try:
            await anyio.sleep_forever()
        finally:
            cleaned.append(True)
        return 0  # pragma: no cover - never reached

    async def leave() -> None:
        await anyio.sleep(0.01)
        client.left.set()

    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(leave)
            assert await unless_disconnected(client.receive, work) == (False, None)
    assert cleaned == [True]


async def test_abort_all_drops_every_request_and_the_gauges_say_so_at_once() -> None:
    metrics = ServeMetrics("m", CONFIG, 1)
    driver = EngineDriver(CONFIG, speedup_ratio=0, metrics=metrics)

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    with anyio.fail_after(GUARD_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(driver.run)
            outboxes = [driver.submit(spec(f"r{i}", 40)) for i in range(3)]
            for outbox in outboxes:
                await outbox.receive()  # all three are running
            assert (gauge("vllm:kv_cache_usage_perc") or 0) > 0
            driver.abort_all()
            for outbox in outboxes:  # each ends without a last output
                assert not any([o.finished async for o in outbox])
            while driver.outstanding:  # the driver has accounted for the aborts
                await anyio.sleep(0.001)
            engine = driver.engine
            assert engine is not None
            assert not engine.has_work
            # no step follows an abort of everything: the report came with the aborts
            assert gauge("vllm:num_requests_running") == 0
            assert gauge("vllm:kv_cache_usage_perc") == 0
            driver.close()
    assert driver.shutdown_aborted == 3
    assert gauge("vllm:request_success_total", finished_reason="abort") == 3
    assert gauge("vllm:request_success_total", finished_reason="length") == 0
    assert driver.outstanding == 0
    assert driver.leaked_blocks == 0
