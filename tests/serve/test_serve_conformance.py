"""``kvpool serve`` takes request fields as vLLM 0.33's OpenAI server does.

Over loopback sockets: ``model`` optional, vLLM's error bodies, ``max_completion_tokens``
first, vLLM's types (lax) and ranges, ``stop`` and ``stop_token_ids``, ``n``,
``logprobs``, ``echo``, and a 400 naming any field the mock cannot honour. Expected
values come from the requests themselves (a first answer, the tokenizer's vocabulary),
never from the server's code.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_processes import Served
from tokenizers import Tokenizer, models, pre_tokenizers

from kvpool.engine import EngineConfig
from kvpool.serve import HfTokenizer, ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 20
MODEL = "kvpool-mock"
WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the server is uvicorn's: asyncio-bound


def small_state(**overrides: Any) -> ServeState:
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    options: dict[str, Any] = {"speedup_ratio": 0.0}
    options.update(overrides)
    return ServeState(config, **options)


def word_tokenizer(tmp_path: Path) -> HfTokenizer:
    """One token per word, id = position in `WORDS`: a token's id is readable from text."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return HfTokenizer(str(path))


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def streamed(response: httpx.Response) -> list[dict[str, Any]]:
    events = [e for e in response.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [msgspec.json.decode(e[len(b"data: ") :]) for e in events[:-1]]


async def test_model_is_optional_and_max_completion_tokens_comes_first() -> None:
    messages = [{"role": "user", "content": "hello"}]
    with anyio.fail_after(GUARD_S):
        async with running_server(small_state()) as url, httpx.AsyncClient(base_url=url) as c:
            completion = await post(c, "/v1/completions", {"prompt": "a b c", "max_tokens": 2})
            empty = await post(c, "/v1/completions", {"model": "", "prompt": "a", "max_tokens": 1})
            chat = await post(
                c,
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 2, "max_completion_tokens": 5},
            )
    assert completion["model"] == MODEL
    assert completion["usage"]["completion_tokens"] == 2
    assert empty["usage"]["completion_tokens"] == 1
    assert chat["usage"]["completion_tokens"] == 5  # vLLM: max_completion_tokens wins


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "status", "kind", "param"),
    [
        pytest.param({"temperature": "hot"}, 400, "Bad Request", "body.temperature", id="temp"),
        pytest.param({"top_p": 7}, 400, "BadRequestError", "top_p", id="top-p"),
        pytest.param({"temperature": 2.5}, 400, "BadRequestError", "temperature", id="temp-2.5"),
        pytest.param({"stop": 5}, 400, "Bad Request", "body.stop", id="stop-int"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, 400, "Bad Request", "body.stop"),
        pytest.param({"logprobs": "x"}, 400, "Bad Request", "logprobs", id="logprobs-str"),
        pytest.param({"logprobs": 21}, 400, "BadRequestError", "logprobs", id="logprobs-21"),
        pytest.param({"n": 0}, 400, "BadRequestError", None, id="n-0"),
        pytest.param({"n": 2, "temperature": 0}, 400, "BadRequestError", None, id="greedy-n"),
        pytest.param(
            {"stream_options": {"include_usage": True}},
            400,
            "Bad Request",
            "stream_options",
            id="options-without-stream",
        ),
        pytest.param({"use_beam_search": True}, 400, "BadRequestError", "use_beam_search"),
        pytest.param({"logit_bias": {"5": 10}}, 400, "BadRequestError", "logit_bias"),
        pytest.param(
            {"response_format": {"type": "json_object"}}, 400, "BadRequestError", "response_format"
        ),
        pytest.param({"suffix": "end"}, 400, "BadRequestError", "suffix"),
        pytest.param({"prompt_logprobs": 1}, 400, "BadRequestError", "prompt_logprobs"),
        pytest.param({"priority": 3}, 400, "BadRequestError", "priority"),
        pytest.param(
            {"temperature": "0.5", "max_tokens": "3", "n": 2.0}, 200, "", None, id="lax-numbers"
        ),
        pytest.param(
            {"seed": 7, "top_k": -1, "min_p": 0.1, "presence_penalty": 1},
            200,
            "",
            None,
            id="sampling-knobs",
        ),
    ],
)
async def test_fields_get_vllms_types_ranges_and_refusals(
    field: dict[str, Any], status: int, kind: str, param: str | None
) -> None:
    state = small_state()
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": "a b", "max_tokens": 2, **field}
            )
    assert response.status_code == status, response.text
    if status == 200:
        return
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (kind, status, param)
    assert state.leaked_blocks == 0


async def test_chat_refuses_what_the_mock_cannot_do() -> None:
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with anyio.fail_after(GUARD_S):
        async with running_server(small_state()) as url, httpx.AsyncClient(base_url=url) as c:
            tools = await c.post(
                "/v1/chat/completions", json={"messages": messages, "tools": [tool]}
            )
            top = await c.post(
                "/v1/chat/completions", json={"messages": messages, "top_logprobs": 2}
            )
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
            media = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": [image]}]},
            )
            fine = await c.post(
                "/v1/chat/completions",
                json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
            )
    assert tools.status_code == 400
    assert tools.json()["error"]["param"] == "tools"
    assert top.status_code == 400  # top_logprobs needs logprobs: true
    assert top.json()["error"]["param"] == "top_logprobs"
    assert media.status_code == 400  # never silently dropped
    assert media.json()["error"]["param"] == "messages"
    assert fine.status_code == 200


def stop_count(metrics: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
        and sample.labels["finished_reason"] == "stop"
    )


async def test_stop_strings_end_the_output_streamed_or_not() -> None:
    state = small_state(speedup_ratio=1.0)  # paced: the stop comes long before the end
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            prompt = {"prompt": "tell me a story"}
            first = {**prompt, "max_tokens": 8}  # the same prompt: the same first words
            full = (await post(client, "/v1/completions", first))["choices"][0]["text"]
            words = full.split()
            stop = words[3]  # the fourth word: the first three come before it
            body = {**prompt, "max_tokens": 200}
            stopped = await post(client, "/v1/completions", {**body, "stop": [stop, "zzz"]})
            kept = await post(
                client,
                "/v1/completions",
                {**body, "stop": stop, "include_stop_str_in_output": True},
            )
            late = await post(client, "/v1/completions", {**body, "stop": stop, "min_tokens": 6})
            stream = await client.post(
                "/v1/completions", json={**body, "stop": stop, "stream": True}
            )
            for _ in range(100):  # the engine counts a stop when it drops the request
                metrics = (await client.get("/metrics")).text
                if stop_count(metrics) >= 4:
                    break
                await anyio.sleep(0.02)
    (choice,) = stopped["choices"]
    assert choice["text"] == full[: full.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert stopped["usage"]["completion_tokens"] == 4  # the token completing the stop counts
    assert kept["choices"][0]["text"] == full[: full.index(stop) + len(stop)]
    # min_tokens: no stop is looked for before 6 tokens; a later occurrence ends it
    assert late["choices"][0]["finish_reason"] == "stop"
    assert late["usage"]["completion_tokens"] > 6
    chunks = streamed(stream)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert stop_count(metrics) == 4  # as vLLM counts them: finished, reason "stop"
    assert state.leaked_blocks == 0


async def test_stop_token_ids_end_the_output(tmp_path: Path) -> None:
    tokenizer = word_tokenizer(tmp_path)
    state = small_state(tokenizer=tokenizer)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"prompt": "w1 w2 w3", "max_tokens": 6}
            full = (await post(client, "/v1/completions", body))["choices"][0]["text"].split()
            stop_id = WORDS.index(full[2])
            stopped = await post(client, "/v1/completions", {**body, "stop_token_ids": [stop_id]})
    (choice,) = stopped["choices"]
    assert choice["text"].split() == full[:2]  # the stop token's text is left out
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert stopped["usage"]["completion_tokens"] == 3
    assert state.leaked_blocks == 0


async def test_n_choices_are_distinct_and_counted_like_vllm() -> None:
    state = small_state()
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"prompt": ["one two", "three four five"], "max_tokens": 3, "n": 3}
            batch = await post(client, "/v1/completions", body)
            again = await post(client, "/v1/completions", body)
            messages = [{"role": "user", "content": "hi"}]
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": messages, "n": 2, "max_tokens": 4, "stream": True},
            )
    choices = batch["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert len({c["text"] for c in choices[:3]}) == 3  # n samples, not n copies
    assert choices == again["choices"]  # deterministic
    assert batch["usage"]["prompt_tokens"] == 2 + 3  # each prompt once, as vLLM counts
    assert batch["usage"]["completion_tokens"] == 6 * 3
    texts = ["", ""]
    for chunk in streamed(chat):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert all(len(t.split()) == 4 for t in texts)
    assert texts[0] != texts[1]
    assert state.leaked_blocks == 0


async def test_logprobs_are_deterministic_and_shaped_like_vllms() -> None:
    with anyio.fail_after(GUARD_S):
        async with running_server(small_state()) as url, httpx.AsyncClient(base_url=url) as c:
            body = {"prompt": "a b c", "max_tokens": 5, "logprobs": 2}
            first = await post(c, "/v1/completions", body)
            second = await post(c, "/v1/completions", body)
            as_ids = await post(c, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
            messages = [{"role": "user", "content": "hi"}]
            chat = await post(
                c,
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 3},
            )
    (choice,) = first["choices"]
    logprobs = choice["logprobs"]
    assert logprobs == second["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == 5
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert len(top) == 2
        assert top[token] == value == max(top.values())
    ids = as_ids["choices"][0]["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in ids)
    assert as_ids["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]
    offsets = logprobs["text_offset"]
    assert offsets == [sum(map(len, logprobs["tokens"][:i])) for i in range(5)]
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    for entry in content:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 3
        assert values == sorted(values, reverse=True)
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["bytes"] == list(entry["token"].encode())


async def test_echo_returns_the_prompt_before_the_output() -> None:
    prompt = "the cache and the pool"
    with anyio.fail_after(GUARD_S):
        async with running_server(small_state()) as url, httpx.AsyncClient(base_url=url) as c:
            plain = await post(c, "/v1/completions", {"prompt": prompt, "max_tokens": 3})
            echoed = await post(
                c, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True}
            )
            only = await post(
                c, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True}
            )
            scored = await post(
                c,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1},
            )
            stream = await c.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 3, "echo": True, "stream": True},
            )
    output = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == prompt + output
    assert only["choices"][0]["text"] == prompt
    assert only["usage"]["completion_tokens"] == 0
    logprobs = scored["choices"][0]["logprobs"]
    prompt_tokens = scored["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + 2
    assert logprobs["token_logprobs"][0] is None  # nothing precedes the first token
    assert "".join(c["choices"][0]["text"] for c in streamed(stream)) == prompt + output


def test_a_client_leaving_mid_upload_logs_no_traceback() -> None:
    served = Served("--port", "0", "--speedup-ratio", "0")
    try:
        host, port = served.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=GUARD_S) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"a " * 100
            )
        response = httpx.post(
            f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "ok"}, timeout=30
        )
        assert response.status_code == 200
    finally:
        status, log = served.stop()
    assert status == 0, log
    assert "Traceback" not in log
    assert "ClientDisconnect" not in log


async def test_return_token_ids_gives_the_ids_of_the_text(tmp_path: Path) -> None:
    tokenizer = word_tokenizer(tmp_path)
    state = small_state(tokenizer=tokenizer)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"prompt": "w1 w2 w3", "max_tokens": 5, "return_token_ids": True}
            plain = await post(client, "/v1/completions", body)
            stream = await client.post("/v1/completions", json={**body, "stream": True})
            messages = [{"role": "user", "content": "w4 w5"}]
            chat = await post(
                client,
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 2, "return_token_ids": True},
            )
    (choice,) = plain["choices"]
    assert choice["prompt_token_ids"] == [1, 2, 3]
    assert [WORDS[i] for i in choice["token_ids"]] == choice["text"].split()
    chunks = [c["choices"][0] for c in streamed(stream)]
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3]
    assert [i for c in chunks for i in c["token_ids"]] == choice["token_ids"]
    (message,) = chat["choices"]
    assert [WORDS[i] for i in message["token_ids"]] == message["message"]["content"].split()
    assert chat["prompt_token_ids"] == tokenizer.encode("user: w4 w5\nassistant:")
