"""/metrics as a router scores a worker by it: every change the engine goes through is
reported when it happens, aborts included, without waiting for a later request."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from raw_http import connect, drop, read_head, read_until, request_bytes
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig, TimingModel
from kvpool.serve import ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 60
MODEL = "kvpool-mock"


anyio_backend = uvicorn_backend_fixture()


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("engine") == "0" and "le" not in sample.labels:
                values[sample.name] = sample.value
    return values


@pytest.mark.slow
async def test_500_streams_dropped_at_once_leave_the_gauges_at_zero() -> None:
    # 500 streams of 8000 tokens on a real-time engine (10 ms steps): 256 run, the rest
    # wait; all leave together. Nothing is sent afterwards but /metrics scrapes, so the
    # gauges must come from the aborts themselves.
    timing = TimingModel(step_overhead_s=0.01)
    config = EngineConfig(num_gpu_blocks=16384, block_size=16, timing=timing)
    state = ServeState(config, speedup_ratio=1.0)
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 8000, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            connections = [await connect(url) for _ in range(500)]
            for _, writer in connections:
                writer.write(request_bytes("/v1/completions", body))
            for reader, _ in connections:
                status, _ = await read_head(reader)
                assert status == 200
            engine = state.drivers[0].engine
            assert engine is not None
            while len(engine.running) + len(engine.waiting) < 500:
                await anyio.sleep(0.01)
            await read_until(connections[0][0], b"data: {")  # the engine is streaming
            busy = await gauges(client)
            for _, writer in connections:
                await drop(writer)
            while engine.stats.aborted < 500:
                await anyio.sleep(0.01)
            await asyncio.sleep(0.05)  # the driver reports at once: no step follows
            idle = await gauges(client)
            assert not engine.has_work
    assert busy["vllm:num_requests_running"] + busy["vllm:num_requests_waiting"] == 500
    assert busy["vllm:kv_cache_usage_perc"] > 0
    assert idle["vllm:num_requests_running"] == 0
    assert idle["vllm:num_requests_waiting"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["vllm:gpu_cache_usage_perc"] == 0
    # an aborted request is no success, as in vLLM (its stats are dropped with it)
    assert idle.get("vllm:request_success_total", 0) == 0
    assert idle["vllm:e2e_request_latency_seconds_count"] == 0
    assert state.leaked_blocks == 0


async def test_one_dropped_stream_leaves_no_usage_behind() -> None:
    timing = TimingModel(step_overhead_s=0.01)
    config = EngineConfig(num_gpu_blocks=256, block_size=4, timing=timing)
    state = ServeState(config, speedup_ratio=1.0)
    body = {"model": MODEL, "prompt": "a b c d e f g h i j", "max_tokens": 500, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            reader, writer = await connect(url)
            writer.write(request_bytes("/v1/completions", body))
            await read_until(reader, b"data: {")
            assert (await gauges(client))["vllm:kv_cache_usage_perc"] > 0
            await drop(writer)
            engine = state.drivers[0].engine
            assert engine is not None
            while engine.stats.aborted == 0:
                await anyio.sleep(0.005)
            await asyncio.sleep(0.05)
            idle = await gauges(client)
    assert idle["vllm:num_requests_running"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
