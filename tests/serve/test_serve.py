"""``kvpool serve`` in-process: the OpenAI API (real ``openai`` SDK and httpx), /metrics
(prometheus_client's parser), aborts on disconnect, and KV events to a ZMQ subscriber.

The server runs on uvicorn inside the test's own event loop (`running_server`, port 0 on
127.0.0.1), so these tests run on asyncio and uvloop only: the server is asyncio-bound.
"""

from __future__ import annotations

import asyncio
import gc
import math
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import zmq
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig, TimingModel
from kvpool.events import BlockStored, ZmqEventPublisher, decode_batch
from kvpool.serve import BuiltinTokenizer, ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 20
MODEL = "kvpool-mock"


anyio_backend = uvicorn_backend_fixture()


def small_state(**overrides: Any) -> ServeState:
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    options: dict[str, Any] = {"speedup_ratio": 0.0}
    options.update(overrides)
    return ServeState(config, **options)


async def metric_samples(client: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """``(sample name, engine) -> value`` from /metrics, parsed by prometheus_client."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if "le" in sample.labels or "finished_reason" in sample.labels:
                continue
            samples[(sample.name, sample.labels.get("engine", ""))] = sample.value
    return samples


async def test_health_and_models_answer_like_vllm() -> None:
    state = small_state()
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 200
            models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    [model] = models["data"]
    assert model["id"] == MODEL
    assert model["max_model_len"] == 256 * 4
    assert state.leaked_blocks == 0


async def test_completions_take_text_token_ids_and_batches_and_report_cached_tokens() -> None:
    state = small_state()
    prompt = "the quick brown fox jumps over the lazy dog " * 3  # 27 tokens: 6 full blocks
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:

            async def complete(**body: Any) -> dict[str, Any]:
                response = await client.post("/v1/completions", json={"model": MODEL, **body})
                assert response.status_code == 200, response.text
                result: dict[str, Any] = response.json()
                return result

            first = await complete(prompt=prompt, max_tokens=5)
            again = await complete(prompt=prompt, max_tokens=5)
            ids = await complete(prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=3)
            batch = await complete(prompt=["a b c", "d e f g"], max_tokens=2, min_tokens=1)
            id_batch = await complete(prompt=[[1, 2], [3, 4, 5]], max_tokens=1, ignore_eos=True)
    assert first["usage"] == {
        "prompt_tokens": 27,
        "completion_tokens": 5,
        "total_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # deterministic text; the repeat hits every full block but the one holding its last token
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert len(first["choices"][0]["text"].split()) == 5
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 24
    assert first["choices"][0]["finish_reason"] == "length"
    assert ids["usage"]["prompt_tokens"] == 9
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["prompt_tokens"] == 3 + 4
    assert batch["usage"]["completion_tokens"] == 4
    assert id_batch["usage"]["completion_tokens"] == 2
    assert state.leaked_blocks == 0


async def test_openai_sdk_streams_concurrently_with_usage() -> None:
    state = small_state(speedup_ratio=1.0, data_parallel_size=2)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            results: dict[int, tuple[str, Any]] = {}

            async def chat(n: int) -> None:
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question number {n}"}],
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        usage = chunk.usage
                results[n] = (text, usage)

            async def complete(n: int) -> None:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"prompt {n}", max_tokens=4, stream=True
                )
                text = "".join([chunk.choices[0].text async for chunk in stream])
                results[100 + n] = (text, None)

            async with anyio.create_task_group() as tasks:
                for n in range(8):
                    tasks.start_soon(chat, n)
                    tasks.start_soon(complete, n)
            plain = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "question number 0"}],
                max_tokens=6,
            )  # fmt: skip
            await client.close()
    assert len(results) == 16
    for n in range(8):
        text, usage = results[n]
        assert len(text.split()) == 6
        assert usage.completion_tokens == 6
        assert usage.prompt_tokens_details.cached_tokens >= 0
        assert len(results[100 + n][0].split()) == 4
    # the same conversation gives the same text, streamed or not
    assert plain.choices[0].message.content == results[0][0]
    assert plain.usage is not None
    assert plain.usage.prompt_tokens_details is not None
    # both data-parallel ranks served some of the 16 concurrent requests
    assert all(driver.engine is not None for driver in state.drivers)
    assert all(d.engine.stats.completed > 0 for d in state.drivers if d.engine)
    assert state.leaked_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("body", "status", "kind", "param", "fragment"),
    [
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": ', 400, "Bad Request", "body", "JSON", id="json"
        ),
        pytest.param(
            b'{"model": "gpt-4", "prompt": "x"}',
            404,
            "NotFoundError",
            "model",
            "does not exist",
            id="model",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": "x", "max_tokens": -1}',
            400,
            "BadRequestError",
            "max_tokens",
            "at least 1",
            id="negative-max-tokens",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": "x", "max_tokens": 4, "min_tokens": 5}',
            400,
            "BadRequestError",
            None,
            "min_tokens",
            id="min-above-max",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": [1, 2], "max_tokens": 1024}',
            400,
            "BadRequestError",
            "max_tokens",
            "maximum context length is 1024",
            id="larger-than-the-cache",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": ""}',
            400,
            "Bad Request",
            "prompt",
            "non-empty",
            id="empty",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": [1, "a"]}',
            400,
            "Bad Request",
            "body.prompt",
            "prompt must",
            id="mixed",
        ),
        pytest.param(
            b'{"model": "kvpool-mock", "prompt": [-1]}',
            400,
            "Bad Request",
            "body.prompt",
            "greater than or equal to 0",
            id="negative-id",
        ),
    ],
)
async def test_bad_input_gets_vllms_status_and_error_body(
    body: bytes, status: int, kind: str, param: str | None, fragment: str
) -> None:
    state = small_state()
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            chat = await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
            still_fine = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}
            )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (kind, status, param)
    assert fragment in error["message"]
    assert chat.status_code == 404
    assert still_fine.status_code == 200  # a bad request leaves the server usable
    assert state.leaked_blocks == 0


async def test_metrics_use_vllms_names_and_agree_with_the_requests() -> None:
    state = small_state(data_parallel_size=2)
    prompt = "one two three four five six seven eight nine ten"  # 10 tokens
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            before = await metric_samples(client)
            for _ in range(3):  # one at a time: least-loaded sends them all to rank 0
                response = await client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3}
                )
                assert response.status_code == 200
            after = await metric_samples(client)
            text = (await client.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:cache_config_info",
    ):
        assert (name, "0") in before, name
        assert (name, "1") in before, name
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert after[(f"{histogram}_count", "0")] > 0, histogram
    assert 'vllm:request_success_total{engine="0",finished_reason="length"' in text
    assert after[("vllm:generation_tokens_total", "0")] == 9
    assert after[("vllm:prompt_tokens_total", "0")] == 30
    assert after[("vllm:time_to_first_token_seconds_count", "0")] == 3
    assert after[("vllm:inter_token_latency_seconds_count", "0")] == 6
    assert after[("vllm:e2e_request_latency_seconds_count", "0")] == 3
    # queries count each admission's tokens; the repeats hit 8 of 10 (2 full blocks of 4)
    assert after[("vllm:prefix_cache_queries_total", "0")] == 30
    assert after[("vllm:prefix_cache_hits_total", "0")] == 16
    assert after[("vllm:gpu_prefix_cache_hits_total", "0")] == 16
    assert after[("vllm:num_requests_running", "0")] == 0
    assert after[("vllm:kv_cache_usage_perc", "0")] == 0.0
    assert after[("vllm:cache_config_info", "1")] == 1
    assert after[("vllm:generation_tokens_total", "1")] == 0  # rank 1 had nothing to do


async def test_a_finished_stream_leaves_no_task_behind_on_a_kept_alive_connection() -> None:
    # The stream's disconnect listener is not cancelled: it must end because the server
    # answers its pending receive once the response is complete, even on a connection
    # the client keeps open. A listener left waiting would keep the request's task alive.
    state = small_state()
    body = {"model": MODEL, "prompt": "one two three", "max_tokens": 5, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/health")).status_code == 200  # the connection is open
            before = len(asyncio.all_tasks())
            for _ in range(3):
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line]
                assert lines[-1] == "data: [DONE]"
                assert len(lines) == 6  # five tokens, then [DONE]
            while len(asyncio.all_tasks()) > before:
                await anyio.sleep(0.01)
            assert (await client.get("/health")).status_code == 200  # still the same server
    assert state.leaked_blocks == 0


@pytest.mark.slow
async def test_a_client_leaving_while_its_request_waits_in_the_queue_aborts_it() -> None:
    # One sequence at a time, 20 ms steps at real time: the second stream waits behind
    # the first, writes nothing, and its client leaves. The disconnect listener alone
    # must notice, and the engine drop the queued request without running it.
    timing = TimingModel(step_overhead_s=0.02)
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_seqs=1, timing=timing)
    state = ServeState(config, speedup_ratio=1.0)
    first = {"model": MODEL, "prompt": "first in line", "max_tokens": 30}
    queued = {"model": MODEL, "prompt": "second in line", "max_tokens": 30, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            async with anyio.create_task_group() as tasks:
                done: list[httpx.Response] = []

                async def run_first() -> None:
                    done.append(await client.post("/v1/completions", json=first))

                tasks.start_soon(run_first)
                driver = state.drivers[0]
                engine = driver.engine
                assert engine is not None
                while not engine.running:
                    await anyio.sleep(0.005)
                async with client.stream("POST", "/v1/completions", json=queued) as response:
                    assert response.status_code == 200
                    while len(engine.waiting) == 0:
                        await anyio.sleep(0.005)
                # leaving the block closed the connection before any token was written
                while engine.stats.aborted == 0:
                    await anyio.sleep(0.005)
                assert engine.running  # the first request is still decoding
            [answer] = done
            assert answer.status_code == 200
            assert answer.json()["usage"]["completion_tokens"] == 30
            assert engine.stats.completed == 1  # the queued one never ran
            assert not engine.has_work
            assert driver.outstanding == 0
            usage = await engine.final_usage()
            assert usage.num_active == 0
    assert state.leaked_blocks == 0


async def test_a_client_disconnecting_mid_stream_aborts_and_frees_its_blocks() -> None:
    state = small_state(speedup_ratio=1.0)
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 500, "stream": True}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                chunks = 0
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        break  # leaving the block closes the connection mid-stream
            driver = state.drivers[0]
            engine = driver.engine
            assert engine is not None
            while engine.stats.aborted == 0:  # the driver notices at its next step
                await anyio.sleep(0.01)
            usage = await engine.final_usage()  # through the pool actor; checks invariants
            assert usage.num_active == 0
            assert not engine.has_work
            assert engine.stats.completed == 0
            assert driver.outstanding == 0
    assert state.leaked_blocks == 0


async def test_a_zmq_subscriber_sees_vllm_events_while_serving() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher = ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx
    )
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    state = small_state(sinks=[publisher])
    tokenizer = BuiltinTokenizer()
    stored: list[BlockStored] = []
    try:
        with anyio.fail_after(GUARD_S):
            async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
                n = 0
                while not stored:  # PUB drops until the subscription lands: retry
                    prompt = f"event probe {n} with enough words to fill blocks"
                    n += 1
                    response = await client.post(
                        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                    )
                    assert response.status_code == 200
                    await anyio.sleep(0.02)
                    while sub.poll(0):
                        _, _, payload = sub.recv_multipart()
                        batch = decode_batch(payload)
                        assert batch.data_parallel_rank == 0
                        stored += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        sub.close()
        publisher.close()
        ctx.term()
    event = stored[0]
    assert event.block_size == 4
    assert len(event.token_ids) == 4 * len(event.block_hashes)
    assert event.parent_block_hash is None
    # the stored tokens are the prompt's, as the tokenizer produced them
    probe = next(
        f"event probe {k} with enough words to fill blocks"
        for k in range(n)
        if tokenizer.encode(f"event probe {k} with enough words to fill blocks")[:4]
        == event.token_ids[:4]
    )
    assert tokenizer.encode(probe)[: len(event.token_ids)] == event.token_ids
    assert math.isfinite(state.metrics.registry.get_sample_value(
        "vllm:kv_cache_usage_perc", {"model_name": MODEL, "engine": "0"}
    ) or 0.0)  # fmt: skip


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streamed_chunks_are_openais_compact_json_byte_for_byte(chat: bool) -> None:
    """Every SSE event is ``data: `` and the compact JSON of OpenAI's chunk, keys in
    OpenAI's order (the token chunks come from a template, not an encoder)."""
    state = small_state()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "stream": True}
    body.update(
        {"messages": [{"role": "user", "content": 'say "hi" \\ twice'}]}
        if chat
        else {"prompt": 'say "hi" \\ twice'}
    )
    encode = msgspec.json.encode
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post(path, json=body)
    events = [e for e in response.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    texts = []
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        chunk = msgspec.json.decode(event[len(b"data: ") :])
        assert list(chunk) == ["id", "object", "created", "model", "choices"]
        (choice,) = chunk["choices"]
        content = ["delta"] if chat else ["text"]
        keys = ["index", *content, "logprobs", "finish_reason", "stop_reason"]
        if chat and "role" in choice["delta"]:  # the opening chunk sets no stop_reason
            keys.remove("stop_reason")
        assert list(choice) == keys
        assert event == b"data: " + encode(chunk)  # compact, as an encoder writes it
        texts.append(choice["delta"].get("content", "") if chat else choice["text"])
    finishes = [msgspec.json.decode(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes == [None] * (len(finishes) - 1) + ["length"]
    assert len(texts) == 6 + chat  # chat opens with the assistant's role
    assert "".join(texts)


@pytest.mark.slow
async def test_the_startup_heap_is_frozen_only_when_asked() -> None:
    """`kvpool serve` marks its startup heap static, as vLLM's server does; an embedded
    server leaves its caller's heap alone unless told to."""
    before = gc.get_freeze_count()
    try:
        with anyio.fail_after(GUARD_S):
            async with running_server(small_state()):
                assert gc.get_freeze_count() == before
            async with running_server(small_state(), freeze_gc=True):
                assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


async def test_every_finish_reason_has_a_series_from_the_start() -> None:
    """vLLM creates ``vllm:request_success`` for each of its finish reasons and engines
    at start-up (at 0), so an abort-rate query has a series before the first abort."""
    state = small_state(data_parallel_size=2)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            text = (await client.get("/metrics")).text
    found = {
        (sample.labels["engine"], sample.labels["finished_reason"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
    }
    reasons = ("stop", "length", "abort", "error", "repetition")  # vLLM 0.33's strings
    assert found == {(engine, reason): 0.0 for engine in ("0", "1") for reason in reasons}


@pytest.mark.slow
async def test_a_request_sent_while_a_step_runs_waits_for_it_in_its_queue_time() -> None:
    """vLLM stamps a request's arrival in its API server: one sent while a step runs is
    queued until that step ends, and ``vllm:request_queue_time_seconds`` says so (the
    engine stamps it later, at the step's end, so every such wait read 0). Steps of
    100 ms at real time: the second request is sent as the first one's first token
    arrives, while the first one still has 9 steps to run."""
    timing = TimingModel(step_overhead_s=0.1, prefill_token_s=0.0, decode_seq_s=0.0)
    config = EngineConfig(num_gpu_blocks=256, block_size=4, timing=timing)
    state = ServeState(config, speedup_ratio=1.0)
    long = {"model": MODEL, "prompt": "first", "max_tokens": 10, "stream": True}
    short = {"model": MODEL, "prompt": "second", "max_tokens": 1}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json=long) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                assert (await client.post("/v1/completions", json=short)).status_code == 200
                async for _ in lines:
                    pass
            samples = await metric_samples(client)
    count = samples[("vllm:request_queue_time_seconds_count", "0")]
    waited = samples[("vllm:request_queue_time_seconds_sum", "0")]
    assert count == 2
    assert 0 < waited <= 0.1  # the second's wait, at most one step of simulated time
    assert state.leaked_blocks == 0
