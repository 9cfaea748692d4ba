"""vLLM's per-request and per-step histograms in /metrics, against the requests' usage.

vLLM 0.33 records, per finished request, its prompt and generated tokens, its prefill,
decode and inference times and its time per output token, and per step the tokens it
computed; `kvpool serve` records the same series, with vLLM's names, labels and buckets.
"""

from __future__ import annotations

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig
from kvpool.serve import ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 20


anyio_backend = uvicorn_backend_fixture()


async def samples(client: httpx.AsyncClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed by prometheus_client."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(found: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in found.get(name, []))


async def test_vllms_request_histograms_agree_with_the_usage() -> None:
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    state = ServeState(config, speedup_ratio=0.0)
    prompts = ["one two three", "four five six seven eight", "nine"]
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            usages = []
            for i, prompt in enumerate(prompts):
                body = {"model": "kvpool-mock", "prompt": prompt, "max_tokens": 3 + i}
                response = await client.post("/v1/completions", json=body)
                usages.append(response.json()["usage"])
            found = await samples(client)
    n = len(prompts)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert total(found, "vllm:request_prompt_tokens_count") == n
    assert total(found, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert total(found, "vllm:request_generation_tokens_sum") == generated
    for name in (
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert total(found, f"{name}_count") == n, name
    # no prefix hits here: every prompt token is computed once, every output generated once
    assert total(found, "vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    # the legacy name carries the inter-token latencies
    itl = total(found, "vllm:inter_token_latency_seconds_count")
    assert total(found, "vllm:time_per_output_token_seconds_count") == itl == generated - n
    # vLLM's buckets: 1-2-5 up to the model length (1024), and powers of two per step
    bounds = [
        labels["le"]
        for labels, _ in found["vllm:request_prompt_tokens_bucket"]
        if labels["engine"] == "0"
    ]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0",
                      "1000.0", "+Inf"]  # fmt: skip
    iteration = [
        labels["le"]
        for labels, _ in found["vllm:iteration_tokens_total_bucket"]
        if labels["engine"] == "0"
    ]
    assert iteration[:3] == ["1.0", "8.0", "16.0"]
    assert iteration[-2:] == ["16384.0", "+Inf"]
