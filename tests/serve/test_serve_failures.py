"""Failure injection for router tests, over loopback.

``--fail-first N`` fails the first N valid requests with the chosen kinds in turn (429,
503, 500 with vLLM's error bodies, or a connection cut mid-response); ``--failure-rate``
fails a seeded share of them. Every failure is counted in /metrics.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_processes import Served
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig
from kvpool.serve import ServeState, running_server
from kvpool.serve.failures import FailureInjector

pytestmark = pytest.mark.anyio
GUARD_S = 20


anyio_backend = uvicorn_backend_fixture()


def small_state(**overrides: Any) -> ServeState:
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    options: dict[str, Any] = {"speedup_ratio": 0.0}
    options.update(overrides)
    return ServeState(config, **options)


async def samples(client: httpx.AsyncClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed by prometheus_client."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(
        value
        for got, value in found.get(name, [])
        if all(got.get(k) == v for k, v in labels.items())
    )


async def test_fail_first_answers_each_kind_then_serves() -> None:
    kinds = ("rate_limit", "overloaded", "server_error", "disconnect")
    state = small_state(failures=FailureInjector(types=kinds, fail_first=4))
    body = {"prompt": "retry me", "max_tokens": 2}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            bad = await client.post("/v1/completions", json={"prompt": ""})  # not a failure
            answers = [await client.post("/v1/completions", json=body) for _ in range(3)]
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/v1/completions", json=body)
            served = await client.post("/v1/completions", json=body)
            found = await samples(client)
    assert bad.status_code == 400
    assert [a.status_code for a in answers] == [429, 503, 500]
    errors = [a.json()["error"] for a in answers]
    assert [e["type"] for e in errors] == [
        "Too Many Requests",
        "Service Unavailable",
        "InternalServerError",
    ]
    assert [e["code"] for e in errors] == [429, 503, 500]
    assert served.status_code == 200
    for kind in kinds:
        assert total(found, "kvpool:injected_failures_total", type=kind) == 1
    assert state.leaked_blocks == 0


async def test_a_stream_is_cut_after_its_first_chunk_and_its_request_aborted() -> None:
    state = small_state(
        speedup_ratio=1.0, failures=FailureInjector(types=["disconnect"], fail_first=1)
    )
    body = {"prompt": "a long answer", "max_tokens": 200, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            chunks: list[bytes] = []

            async def read() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_bytes():  # kept up to the cut
                        chunks.append(chunk)  # noqa: PERF401

            with pytest.raises(httpx.RemoteProtocolError):
                await read()
            assert b"data: {" in b"".join(chunks)
            assert b"[DONE]" not in b"".join(chunks)
            again = await client.post("/v1/completions", json={**body, "max_tokens": 2})
    assert again.status_code == 200
    assert state.leaked_blocks == 0


async def test_a_failure_rate_fails_a_seeded_share_and_counts_each() -> None:
    state = small_state(failures=FailureInjector(0.5, ["rate_limit", "server_error"], seed=3))
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            codes = [
                (
                    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                ).status_code
                for _ in range(40)
            ]
            found = await samples(client)
    failed = [c for c in codes if c != 200]
    assert 5 < len(failed) < 35
    assert set(failed) <= {429, 500}
    assert total(found, "kvpool:injected_failures_total") == len(failed)
    assert total(found, "kvpool:injected_failures_total", type="rate_limit") == failed.count(429)


def test_kvpool_serve_failure_flags() -> None:
    served = Served(
        "--port",
        "0",
        "--speedup-ratio",
        "0",
        "--fail-first",
        "1",
        "--failure-types",
        "overloaded",
    )
    try:
        body = {"prompt": "x", "max_tokens": 1}
        first = httpx.post(f"{served.url}/v1/completions", json=body, timeout=GUARD_S)
        second = httpx.post(f"{served.url}/v1/completions", json=body, timeout=GUARD_S)
    finally:
        status, log = served.stop()
    assert (first.status_code, second.status_code) == (503, 200)
    assert status == 0, log
