"""No request can stall the others: bodies are read within a limit (413 beyond it, the
rest unread), a batch's size and its texts' lengths are checked before anything is
tokenized, and big bodies are parsed on a worker thread. Real sockets on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import anyio
import httpx
import pytest
from raw_http import connect, read_head, request_bytes
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig
from kvpool.serve import BuiltinTokenizer, RequestLimits, ServeState, running_server
from kvpool.serve.intake import MAX_CHARS_PER_TOKEN, OFF_LOOP_BYTES, check_batch_unparsed
from kvpool.serve.protocol import ApiError

pytestmark = pytest.mark.anyio
GUARD_S = 30
MODEL = "kvpool-mock"
FIFTY_MB = 50 * 2**20


anyio_backend = uvicorn_backend_fixture()


class RecordingTokenizer(BuiltinTokenizer):
    """The built-in tokenizer, noting the length of every text and the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []  # (characters, on the main thread)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls.append((len(text), threading.current_thread() is threading.main_thread()))
        return super().encode(text, add_special_tokens)


def small_state(num_gpu_blocks: int = 256, **overrides: Any) -> ServeState:
    config = EngineConfig(num_gpu_blocks=num_gpu_blocks, block_size=4, max_num_batched_tokens=256)
    options: dict[str, Any] = {"speedup_ratio": 0.0, "tokenizer": RecordingTokenizer()}
    options.update(overrides)
    return ServeState(config, **options)


async def send_until_refused(writer: asyncio.StreamWriter, size: int) -> int:
    """Send ``size`` bytes of body; how many went before the connection failed."""
    sent, chunk = 0, b"x" * 2**20
    try:
        while sent < size:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except ConnectionError:
        return sent
    return sent


def calls(state: ServeState) -> list[tuple[int, bool]]:
    tokenizer = state.tokenizer
    assert isinstance(tokenizer, RecordingTokenizer)
    return tokenizer.calls


async def test_a_50_mb_body_announced_with_expect_100_continue_is_never_sent() -> None:
    # what curl does with a big body: it waits for the server's go-ahead, and gets 413
    state = small_state()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % FIFTY_MB
    )
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            reader, writer = await connect(url)
            writer.write(head)
            status, headers = await read_head(reader)
            answer = await reader.read()  # then the server hangs up
            writer.close()
            fine = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1}
            )
    assert status == 413
    assert b"connection: close" in headers.lower()
    assert b"--max-request-body-bytes" in answer
    assert fine.status_code == 200
    assert calls(state) == [(len("ok"), True)]  # only the small request was tokenized


async def test_a_client_sending_50_mb_whole_gets_413_not_a_reset() -> None:
    # most clients (httpx, requests, the openai SDK) send the whole body before reading
    state = small_state()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % FIFTY_MB
    )
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            reader, writer = await connect(url)
            writer.write(head)
            sent = await send_until_refused(writer, FIFTY_MB)
            status, headers = await read_head(reader)
            writer.close()
    assert sent == FIFTY_MB
    assert status == 413
    assert b"connection: close" in headers.lower()
    assert calls(state) == []


@pytest.mark.parametrize("blocks", [64, 1024, 65536])
def test_the_default_body_limit_takes_the_largest_prompts_and_no_50_mb(blocks: int) -> None:
    state = ServeState(EngineConfig(num_gpu_blocks=blocks, block_size=16))
    tokens = state.max_model_len
    text = json.dumps({"model": MODEL, "prompt": "x" * (tokens * MAX_CHARS_PER_TOKEN)})
    ids = json.dumps({"model": MODEL, "prompt": [2**32 - 1] * tokens})
    assert len(text) <= state.limits.body_bytes
    assert len(ids) <= state.limits.body_bytes
    if tokens <= 2**17:  # up to 128k tokens of context: a 50 MB body is no prompt
        assert state.limits.body_bytes < FIFTY_MB


async def test_a_chunked_body_is_refused_once_it_outgrows_the_limit() -> None:
    state = small_state(limits=RequestLimits(max_request_body_bytes=1000))
    prompt = b'{"model": "kvpool-mock", "prompt": "' + b"word " * 400 + b'"}'
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(prompt), prompt)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            reader, writer = await connect(url)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvpool\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + body
            )
            status, _ = await read_head(reader)
            writer.close()
    assert status == 413
    assert calls(state) == []


async def test_a_50000_prompt_batch_is_refused_before_any_prompt_is_tokenized() -> None:
    state = small_state()
    batch = {"model": MODEL, "prompt": ["word"] * 50_000, "max_tokens": 1}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            reader, writer = await connect(url)
            writer.write(request_bytes("/v1/completions", batch))
            status, _ = await read_head(reader)
            answer = (await reader.read()).decode()
            writer.close()
            within = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": ["a", "b"] * 512, "max_tokens": 1},
            )
    assert status == 400
    # vLLM's refusal, from the count in the raw JSON: nothing was decoded
    assert "prompt list length 50000 exceeds the maximum allowed count of 1024" in answer
    assert within.status_code == 200
    assert len(within.json()["choices"]) == 1024
    assert len(calls(state)) == 1024  # the refused batch tokenized nothing


@pytest.mark.parametrize(
    ("prompt", "refused"),
    [
        pytest.param(["w"] * 1025, True, id="texts"),
        pytest.param([[1, 2]] * 1025, True, id="id-lists"),
        pytest.param(['say "hi", \\'] * 1025, False, id="escapes-undercount"),
        pytest.param(["w"] * 1024, False, id="at-the-limit"),
        pytest.param(list(range(100_000)), False, id="one-id-prompt"),
        pytest.param("a [ text [ with [ brackets", False, id="one-text"),
    ],
)
def test_a_batch_is_counted_in_its_raw_json_before_it_is_decoded(
    prompt: Any, refused: bool
) -> None:
    raw = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    if refused:
        with pytest.raises(ApiError, match="prompt list length 1025 exceeds"):
            check_batch_unparsed(raw)
    else:  # an undercount (a quote after a backslash) is left to the full decode
        check_batch_unparsed(raw)
    check_batch_unparsed(b'{"prompt": [')  # malformed: the decode's job


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_text_longer_than_any_context_is_refused_untokenized(chat: bool) -> None:
    state = small_state()
    text = "a" * (state.max_model_len * MAX_CHARS_PER_TOKEN + 1)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post(path, json=body)
    assert response.status_code == 400
    assert "maximum context length is 1024 tokens" in response.json()["error"]["message"]
    assert calls(state) == []


async def test_a_big_body_is_tokenized_off_the_engines_loop() -> None:
    state = small_state(num_gpu_blocks=8192)  # 32768 tokens
    text = "many words " * (OFF_LOOP_BYTES // 10)  # a body above the threshold
    small = "a few words"
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            big = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}
            )
            little = await client.post("/v1/completions", json={"model": MODEL, "prompt": small})
    assert big.status_code == 200, big.text
    assert big.json()["usage"]["prompt_tokens"] == 2 * (OFF_LOOP_BYTES // 10)
    assert little.status_code == 200
    assert calls(state) == [(len(text), False), (len(small), True)]
