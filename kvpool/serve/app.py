"""The ASGI app: vLLM's OpenAI-compatible routes over the engine drivers (Starlette).

Routes: ``GET /health``, ``GET /v1/models``, ``GET /metrics``, ``POST /v1/completions``
and ``POST /v1/chat/completions``, with ``stream`` (server-sent events in OpenAI's chunk
format, ``data: [DONE]`` last) and ``stream_options.include_usage``.

What the mock decides where OpenAI leaves it open: it never samples an end-of-sequence
token, so every request generates exactly ``max_tokens`` tokens (default
`DEFAULT_MAX_TOKENS`) and finishes with ``finish_reason: "length"``; ``min_tokens``
(<= ``max_tokens``) and ``ignore_eos`` are accepted and change nothing. ``n`` must be 1.
The text is deterministic: the output token ids are a function of the prompt's ids.
``usage.prompt_tokens_details.cached_tokens`` is what the request's first admission
reused from the prefix cache. A client that disconnects has its requests aborted and
their blocks freed leaf first, streaming or not (`kvpool.serve.disconnect`). Bodies
pass `kvpool.serve.intake` (size limit, batch and text checks, big ones parsed on a
worker thread) before any prompt is tokenized.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
import msgspec
import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvpool.serve.disconnect import unless_disconnected
from kvpool.serve.driver import EngineDriver, Output
from kvpool.serve.intake import (
    OFF_LOOP_BYTES,
    OFF_LOOP_TOKENS,
    BodyTooLarge,
    ClientGone,
    check_batch_unparsed,
    check_prompt_sizes,
    check_text_length,
    off_loop,
    read_body,
)
from kvpool.serve.outbox import Outbox
from kvpool.serve.protocol import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    SamplingFields,
    chat_prompt,
)
from kvpool.serve.state import ServeState
from kvpool.serve.tokenizer import decode
from kvpool.workloads import RequestSpec, Segment, mix_seed

_T = TypeVar("_T", bound=SamplingFields)
_json = msgspec.json.Encoder()
_MAX_TOKEN_ID = 2**32 - 1


def _response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    response = _response(exc.body(), exc.status)
    if isinstance(exc, BodyTooLarge):  # the rest of the body stays unread: hang up
        response.headers["connection"] = "close"
    return response


def _gone() -> Response:
    """The answer to a client that left: never delivered (nginx's 499 in the log)."""
    return Response(status_code=499)


def _decode(kind: type[_T], body: bytes) -> _T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None


Write = Callable[[bytes, bool], Awaitable[None]]
"""Send response bytes; the flag says more will follow (False: the response ends)."""


class _EventStream(Response):
    """A server-sent event stream written straight to the ASGI ``send``.

    Starlette's ``StreamingResponse`` ends a response with a write of its own and then
    cancels its disconnect listener, an anyio cancellation that costs more than the
    rest of a stream's end: when a wave of requests finishes in one step, the next step
    starts late (benchmarks/README.md, "Serving"). Here ``produce`` writes its last
    events together with the end of the response, and the listener ends by itself: once
    the response is complete the server answers its pending ``receive`` with
    ``http.disconnect`` (uvicorn does, with either HTTP parser). Only a client that
    leaves first has its listener cancel ``produce``, which then releases its requests.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Write], Awaitable[None]]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(None)
        self._produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        complete = False

        async def write(data: bytes, more: bool) -> None:
            nonlocal complete
            complete = not more
            await send({"type": "http.response.body", "body": data, "more_body": more})

        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with anyio.create_task_group() as tasks:

            async def listen() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not complete:  # the client left mid-stream
                    tasks.cancel_scope.cancel()

            tasks.start_soon(listen)
            await self._produce(write)


class _Job:
    """One prompt of a request: its spec, the rank serving it, its output stream."""

    __slots__ = ("driver", "outputs", "spec")

    def __init__(self, spec: RequestSpec, driver: EngineDriver, outputs: Outbox[Output]) -> None:
        self.spec = spec
        self.driver = driver
        self.outputs = outputs

    def release(self) -> None:
        """Stop listening and abort the request if it is still running (idempotent)."""
        self.outputs.close()
        self.driver.abort(self.spec.request_id)


class _Api:
    """The route handlers, over one `ServeState`."""

    def __init__(self, state: ServeState) -> None:
        self.state = state

    # ------------------------------------------------------------ validation

    def _max_tokens(self, body: SamplingFields) -> int:
        if body.model != self.state.model_name:
            raise ApiError(
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise ApiError("n must be 1 (the mock generates one choice)", param="n")
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if body.min_tokens < 0 or body.min_tokens > max_tokens:
            raise ApiError(
                f"min_tokens must be between 0 and max_tokens ({max_tokens}), "
                f"got {body.min_tokens}",
                param="min_tokens",
            )
        return max_tokens

    def _spec(self, request_id: str, tokens: list[int], max_tokens: int) -> RequestSpec:
        if not tokens:
            raise ApiError("the prompt is empty (it must hold at least one token)", param="prompt")
        if min(tokens) < 0 or max(tokens) > _MAX_TOKEN_ID:
            raise ApiError(f"token ids must be in [0, {_MAX_TOKEN_ID}]", param="prompt")
        total = len(tokens) + max_tokens
        if total > self.state.max_model_len:
            raise ApiError(
                f"This model's maximum context length is {self.state.max_model_len} tokens "
                f"(the whole KV cache). However, you requested {total} tokens "
                f"({len(tokens)} in the messages, {max_tokens} in the completion).",
                param="max_tokens",
            )
        # the output is a function of the prompt: same prompt, same text
        seed = mix_seed(xxhash.xxh64_intdigest(array("I", tokens).tobytes()))
        spec = RequestSpec(
            request_id, 0.0, tuple(Segment(t, 1) for t in tokens), Segment(seed, max_tokens)
        )
        engine = self.state.drivers[0].engine  # every rank has the same config
        reason = engine.rejection_reason(spec) if engine is not None else None
        if reason is not None:
            raise ApiError(f"the request can never run on this engine: it {reason}")
        return spec

    def _start(self, specs: list[RequestSpec]) -> list[_Job]:
        jobs: list[_Job] = []
        try:
            for spec in specs:
                driver = self.state.choose()
                try:
                    outputs = driver.submit(spec)
                except anyio.ClosedResourceError:
                    raise ApiError(
                        "the server is shutting down", status=503, type="service_unavailable"
                    ) from None
                jobs.append(_Job(spec, driver, outputs))
        except BaseException:
            for job in jobs:
                job.release()
            raise
        return jobs

    # ---------------------------------------------------------------- routes

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        state = self.state
        return _response(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": state.created,
                        "owned_by": "kvpool",
                        "root": state.model_name,
                        "parent": None,
                        "max_model_len": state.max_model_len,
                    }
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(
            self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def completions(self, request: Request) -> Response:
        try:
            raw = await read_body(request, self.state.limits.body_bytes)
            body, base, specs = await off_loop(len(raw), partial(self._completion, raw))
            jobs = self._start(specs)
        except ClientGone:
            return _gone()
        except ApiError as exc:
            return _error(exc)
        return await self._answer(body, jobs, base, chat=False, receive=request.receive)

    def _completion(self, raw: bytes) -> tuple[CompletionRequest, str, list[RequestSpec]]:
        if len(raw) > OFF_LOOP_BYTES:  # room for more prompts than a batch may hold
            check_batch_unparsed(raw, self.state.limits)
        body = _decode(CompletionRequest, raw)
        max_tokens = self._max_tokens(body)
        check_prompt_sizes(body.prompt, self.state.limits, self.state.max_model_len)
        prompts = self._prompts(body.prompt)
        base = f"cmpl-{uuid.uuid4().hex}"
        specs = [self._spec(f"{base}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
        return body, base, specs

    async def chat(self, request: Request) -> Response:
        try:
            raw = await read_body(request, self.state.limits.body_bytes)
            body, base, spec = await off_loop(len(raw), partial(self._chat, raw))
            jobs = self._start([spec])
        except ClientGone:
            return _gone()
        except ApiError as exc:
            return _error(exc)
        return await self._answer(body, jobs, base, chat=True, receive=request.receive)

    def _chat(self, raw: bytes) -> tuple[ChatCompletionRequest, str, RequestSpec]:
        body = _decode(ChatCompletionRequest, raw)
        max_tokens = self._max_tokens(body)
        if not body.messages:
            raise ApiError("messages must not be empty", param="messages")
        text = chat_prompt(body.messages)
        check_text_length(text, self.state.max_model_len, "messages")
        tokens = self.state.tokenizer.encode(text)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        return body, base, self._spec(base, tokens, max_tokens)

    def _prompts(self, prompt: Prompt) -> list[list[int]]:
        encode = self.state.tokenizer.encode
        if isinstance(prompt, str):
            return [encode(prompt)]
        if not prompt:
            raise ApiError("the prompt is empty", param="prompt")
        ids = [p for p in prompt if isinstance(p, int)]
        if len(ids) == len(prompt):
            return [ids]
        texts = [p for p in prompt if isinstance(p, str)]
        if len(texts) == len(prompt):
            return [encode(p) for p in texts]
        batch = [p for p in prompt if isinstance(p, list)]
        if len(batch) == len(prompt):
            return batch
        raise ApiError("prompt must be a string, token ids, or a list of either", param="prompt")

    # -------------------------------------------------------------- answers

    async def _answer(
        self, body: SamplingFields, jobs: list[_Job], base: str, *, chat: bool, receive: Receive
    ) -> Response:
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(
                partial(self._stream, jobs, base, chat=chat, include_usage=include_usage)
            )

        async def collect_all() -> list[tuple[list[int], int, str | None]]:
            return [await _collect(job) for job in jobs]

        try:  # queued or running, a client that leaves has its requests aborted
            answered, collected = await unless_disconnected(receive, collect_all)
        finally:
            for job in jobs:
                job.release()
        if not answered or collected is None:
            return _gone()
        results = collected
        for _, _, error in results:
            if error is not None:
                return _error(ApiError(error))
        decode_tokens = self.state.tokenizer
        texts = await off_loop(  # a long answer is detokenized off the engines' loop
            sum(len(tokens) for tokens, _, _ in results),
            lambda: [decode(decode_tokens, tokens) for tokens, _, _ in results],
            threshold=OFF_LOOP_TOKENS,
        )
        choices: list[dict[str, Any]] = []
        for index, text in enumerate(texts):
            if chat:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                )
            else:
                choices.append(
                    {"index": index, "text": text, "logprobs": None, "finish_reason": "length"}
                )
        return _response(
            {
                "id": base,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.state.model_name,
                "choices": choices,
                "usage": _usage(jobs, results),
            }
        )

    async def _stream(
        self, jobs: list[_Job], base: str, write: Write, *, chat: bool, include_usage: bool
    ) -> None:
        """Write SSE chunks, one per generated token; the jobs are released (aborted if
        still running) however this ends, a client disconnect (cancellation) included."""
        model = self.state.model_name
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        tokenizer = self.state.tokenizer

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            body: dict[str, Any] = {
                "id": base,
                "object": kind,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return b"data: " + _json.encode(body) + b"\n\n"

        # A token's chunk is `chunk([choice])` byte for byte, from a prefix and a choice
        # template made once: dicts and a whole encode per token cost more than its write.
        head = chunk([])[: -len(b"]}\n\n")]
        text_field = b'"delta":{"content":%s}' if chat else b'"text":%s'
        no_text = b'"delta":{}' if chat else b'"text":""'
        choice_template = b'{"index":%d,%s,"logprobs":null,"finish_reason":%s}'

        results: list[tuple[list[int], int, str | None]] = [([], 0, None) for _ in jobs]
        try:
            if chat:
                role = {"role": "assistant", "content": ""}
                role_chunk = [{"index": 0, "delta": role, "logprobs": None, "finish_reason": None}]
                await write(chunk(role_chunk), True)
            pending = list(range(len(jobs)))

            def event(index: int, output: Output) -> bytes:
                """One output's SSE event; drops ``index`` from ``pending`` when done."""
                tokens, _, _ = results[index]
                tokens.extend(output.token_ids)
                results[index] = (tokens, output.cached_tokens, output.error)
                if output.error is not None:
                    pending.remove(index)
                    return b"data: " + _json.encode(ApiError(output.error).body()) + b"\n\n"
                text = decode(tokenizer, output.token_ids)
                field = text_field % _json.encode(text) if text else no_text
                reason = b'"length"' if output.finished else b"null"
                if output.finished:
                    pending.remove(index)
                return head + choice_template % (index, field, reason) + b"]}\n\n"

            # Round robin over a batch's prompts (every step sends each running one a
            # token). Outputs that queued up while the client was being written to go
            # out in one write: a loaded server catches up instead of falling behind.
            # The last outputs go out with the usage, [DONE] and the end of the response,
            # in one write.
            last = b""
            while pending:
                for index in list(pending):
                    outputs = jobs[index].outputs
                    try:
                        events = [event(index, await outputs.receive())]
                        while index in pending:
                            events.append(event(index, outputs.receive_nowait()))
                    except anyio.WouldBlock:
                        pass
                    except anyio.EndOfStream:  # ended without a last output (aborted)
                        pending.remove(index)
                        continue
                    if pending:
                        await write(b"".join(events), True)
                    else:
                        last = b"".join(events)
            if include_usage:
                last += chunk([], _usage(jobs, results))
            await write(last + b"data: [DONE]\n\n", False)
        finally:
            for job in jobs:
                job.release()


async def _collect(job: _Job) -> tuple[list[int], int, str | None]:
    tokens: list[int] = []
    cached = 0
    async for output in job.outputs:
        if output.error is not None:
            return tokens, cached, output.error
        tokens.extend(output.token_ids)
        cached = output.cached_tokens
    return tokens, cached, None


def _usage(jobs: list[_Job], results: list[tuple[list[int], int, str | None]]) -> dict[str, Any]:
    prompt = sum(job.spec.input_length for job in jobs)
    completion = sum(len(tokens) for tokens, _, _ in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached for _, cached, _ in results)},
    }


def build_app(
    state: ServeState,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None,
) -> Starlette:
    """The Starlette app over ``state``. By default its lifespan runs the engines
    (`ServeState.running`): they start before the first request and, at shutdown, finish
    the requests they have before the app stops."""
    api = _Api(state)

    @asynccontextmanager
    async def run_engines(app: Starlette) -> AsyncIterator[None]:
        async with state.running():
            yield

    handler = Callable[[Request], Coroutine[Any, Any, Response]]
    routes: list[tuple[str, handler, list[str]]] = [
        ("/health", api.health, ["GET"]),
        ("/v1/models", api.models, ["GET"]),
        ("/metrics", api.metrics, ["GET"]),
        ("/v1/completions", api.completions, ["POST"]),
        ("/v1/chat/completions", api.chat, ["POST"]),
    ]
    return Starlette(
        routes=[Route(path, endpoint, methods=methods) for path, endpoint, methods in routes],
        lifespan=lifespan or run_engines,
    )


__all__ = ["build_app"]
