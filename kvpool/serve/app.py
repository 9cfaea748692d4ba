"""The ASGI app: vLLM's OpenAI-compatible routes over the engine drivers (Starlette).

Routes: ``GET /health``, ``GET /v1/models``, ``GET /metrics``, ``POST /v1/completions``
and ``POST /v1/chat/completions``, with ``stream`` (server-sent events in OpenAI's chunk
format, ``data: [DONE]`` last) and ``stream_options`` (``include_usage``,
``continuous_usage_stats``). Bodies are parsed and refused as vLLM 0.33 does
(`kvpool.serve.protocol`); each choice's text, stops and logprobs are
`kvpool.serve.choices`'.

What the mock decides where vLLM leaves it open: it never samples an end-of-sequence
token, so a request generates ``max_tokens`` tokens (default `DEFAULT_MAX_TOKENS`)
unless a ``stop`` string or ``stop_token_ids`` token ends it first. The text is
deterministic: the output token ids are a function of the prompt's ids and the choice's
index (``n`` > 1 runs one engine request per choice, as vLLM does).
``usage.prompt_tokens_details.cached_tokens`` is what each prompt's first admission
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
from typing import Any

import anyio
import msgspec
import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvpool.engine.admission import rejection_reason
from kvpool.serve.choices import Choice
from kvpool.serve.disconnect import unless_disconnected
from kvpool.serve.driver import EngineDriver, Output
from kvpool.serve.failures import failure_error
from kvpool.serve.intake import (
    OFF_LOOP_BYTES,
    BodyTooLarge,
    ClientGone,
    check_batch_unparsed,
    check_text_length,
    check_text_prompts,
    off_loop,
    read_body,
)
from kvpool.serve.logprobs import completion_logprobs
from kvpool.serve.outbox import Outbox
from kvpool.serve.protocol import (
    ApiError,
    SamplingFields,
    chat_prompt,
    check_chat,
    check_completion,
    check_model,
    parse_chat,
    parse_completion,
    validation_error,
)
from kvpool.serve.state import ServeState
from kvpool.workloads import RequestSpec, Segment, mix_seed

_json = msgspec.json.Encoder()
_MAX_TOKEN_ID = 2**32 - 1


def _response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status, media_type="application/json")


def _error(exc: ApiError) -> Response:
    response = _response(exc.body(), exc.status)
    if isinstance(exc, BodyTooLarge):  # the rest of the body is not wanted: hang up
        response.headers["connection"] = "close"
    return response


def _gone() -> Response:
    """The answer to a client that left: never delivered (nginx's 499 in the log)."""
    return Response(status_code=499)


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
            if not complete:  # cut on purpose (an injected disconnect): stop listening
                tasks.cancel_scope.cancel()


class _Cut(Response):
    """A response that ends the connection after its headers (an injected disconnect):
    the ASGI call returns with the response incomplete, and the server closes it."""

    def __init__(self) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})


class _Job:
    """One engine request of a response: its spec, the rank serving it, its outputs."""

    __slots__ = ("driver", "outputs", "spec")

    def __init__(self, spec: RequestSpec, driver: EngineDriver, outputs: Outbox[Output]) -> None:
        self.spec = spec
        self.driver = driver
        self.outputs = outputs

    def release(self) -> None:
        """Stop listening and abort the request if it is still running (idempotent)."""
        self.outputs.close()
        self.driver.abort(self.spec.request_id)

    def stopped(self) -> None:
        """Its choice ended on a stop: stop listening, end the request as finished."""
        self.outputs.close()
        self.driver.stop(self.spec.request_id)


class _Prompt:
    """One prompt of a request: its ids, its text (for ``echo``), its choices."""

    __slots__ = ("choices", "ids", "text")

    def __init__(self, ids: list[int], text: str | None) -> None:
        self.ids = ids
        self.text = text
        self.choices: list[Choice] = []


class _Plan:
    """What a valid request runs: its prompts and choices, one job per choice (none when
    ``echo`` with ``max_tokens`` 0 only returns the prompt)."""

    __slots__ = ("base", "body", "chat", "choices", "failure", "jobs", "prompts", "specs")

    def __init__(self, body: SamplingFields, base: str, *, chat: bool) -> None:
        self.body = body
        self.base = base
        self.chat = chat
        self.prompts: list[_Prompt] = []
        self.choices: list[Choice] = []
        self.specs: list[RequestSpec] = []  # one per choice, none if echo only
        self.jobs: list[_Job | None] = []
        self.failure: str | None = None

    @property
    def echo(self) -> bool:
        return not self.chat and bool(getattr(self.body, "echo", False))

    def release(self) -> None:
        for job in self.jobs:
            if job is not None:
                job.release()


class _Api:
    """The route handlers, over one `ServeState`."""

    def __init__(self, state: ServeState) -> None:
        self.state = state

    # ------------------------------------------------------------ validation

    def _spec(self, request_id: str, tokens: list[int], max_tokens: int, index: int) -> RequestSpec:
        if not tokens:
            raise ApiError("the prompt is empty (it must hold at least one token)", param="prompt")
        if min(tokens) < 0 or max(tokens) > _MAX_TOKEN_ID:
            raise ApiError(f"token ids must be in [0, {_MAX_TOKEN_ID}]", param="prompt")
        total = len(tokens) + max_tokens
        if total > self.state.max_model_len:
            raise ApiError(
                f"This model's maximum context length is {self.state.max_model_len} tokens "
                f"(the whole KV cache). However, you requested {total} tokens "
                f"({len(tokens)} in the messages, {max_tokens} in the completion). Please "
                "reduce the length of the messages or completion.",
                param="max_tokens",
            )
        # the output is a function of the prompt and the choice: same request, same text
        seed = mix_seed(xxhash.xxh64_intdigest(array("I", tokens).tobytes()))
        if index:
            seed = mix_seed(seed, index)
        spec = RequestSpec(
            request_id, 0.0, tuple(Segment(t, 1) for t in tokens), Segment(seed, max_tokens)
        )
        reason = rejection_reason(self.state.config, spec)  # every rank's config
        if reason is not None:
            raise ApiError(f"the request can never run on this engine: it {reason}")
        return spec

    def _plan(
        self, body: SamplingFields, base: str, prompts: list[_Prompt], *, chat: bool
    ) -> _Plan:
        """Check the request's ranges; make its choices and their engine requests (no
        event loop needed: nothing is started)."""
        plan = _Plan(body, base, chat=chat)
        max_tokens = body.output_limit()
        echo_only = plan.echo and max_tokens == 0
        body.check_ranges(1 if echo_only else max_tokens)
        tokenizer = self.state.tokenizer
        body.check_logprobs(tokenizer.vocab_size)
        specs = plan.specs
        n = body.choices
        for p, prompt in enumerate(prompts):
            echo_text = prompt.text if plan.echo and prompt.text is not None else ""
            for c in range(n):
                choice = Choice(
                    p * n + c, p, tokenizer, prompt.ids, body, text_offset=len(echo_text)
                )
                prompt.choices.append(choice)
                plan.choices.append(choice)
                if not echo_only:
                    request_id = f"{base}-{p}-{c}"
                    specs.append(self._spec(request_id, prompt.ids, max_tokens, c))
        plan.prompts = prompts
        if echo_only:
            for choice in plan.choices:
                choice.finish_reason = "length"
                choice.finished = True
        return plan

    def _launch(self, plan: _Plan) -> None:
        """Draw the request's injected failure (a refusal raises), then start its
        engine requests (on the event loop: the drivers' outboxes wake it)."""
        failures = self.state.failures
        if failures is not None and failures.active:
            plan.failure = failures.draw()
            if plan.failure is not None:
                self.state.metrics.failure(plan.failure)
                if plan.failure != "disconnect":
                    raise failure_error(plan.failure, self.state.model_name)
        if plan.specs:
            plan.jobs = list(self._start(plan.specs))
        else:
            plan.jobs = [None] * len(plan.choices)

    def _start(self, specs: list[RequestSpec]) -> list[_Job]:
        jobs: list[_Job] = []
        try:
            for spec in specs:
                driver = self.state.choose(spec)
                try:
                    outputs = driver.submit(spec)
                except anyio.ClosedResourceError:
                    raise ApiError("the server is shutting down", status=503) from None
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
        header_id = request.headers.get("x-request-id")
        try:
            raw = await read_body(request, self.state.limits.body_bytes)
            plan = await off_loop(len(raw), partial(self._completion, raw, header_id))
            self._launch(plan)
        except ClientGone:  # the client left mid-upload: nobody to answer
            return _gone()
        except ApiError as exc:
            return _error(exc)
        return await self._answer(plan, request.receive)

    def _completion(self, raw: bytes, header_id: str | None) -> _Plan:
        if len(raw) > OFF_LOOP_BYTES:  # room for more prompts than a batch may hold
            check_batch_unparsed(raw)
        body = parse_completion(raw)
        check_model(body, self.state.model_name)
        check_completion(body)
        check_text_prompts(body.prompt, self.state.max_model_len)
        prompts = self._prompts(body.prompt, body.add_special_tokens)
        return self._plan(body, _base_id(header_id, body, "cmpl"), prompts, chat=False)

    async def chat(self, request: Request) -> Response:
        header_id = request.headers.get("x-request-id")
        try:
            raw = await read_body(request, self.state.limits.body_bytes)
            plan = await off_loop(len(raw), partial(self._chat, raw, header_id))
            self._launch(plan)
        except ClientGone:
            return _gone()
        except ApiError as exc:
            return _error(exc)
        return await self._answer(plan, request.receive)

    def _chat(self, raw: bytes, header_id: str | None) -> _Plan:
        body = parse_chat(raw)
        check_model(body, self.state.model_name)
        check_chat(body)
        text = chat_prompt(body.messages)
        check_text_length(text, self.state.max_model_len, "messages")
        ids = self.state.tokenizer.encode(text, body.add_special_tokens)
        base = _base_id(header_id, body, "chatcmpl")
        return self._plan(body, base, [_Prompt(ids, text)], chat=True)

    def _prompts(self, prompt: Any, special: bool) -> list[_Prompt]:
        """vLLM's prompt shapes: text, token ids, or a batch of either."""
        encode = self.state.tokenizer.encode
        if isinstance(prompt, str):
            return [_Prompt(encode(prompt, special), prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [self._ids_prompt(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [_Prompt(encode(p, special), p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            for ids in prompt:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    break
            else:
                return [self._ids_prompt(ids) for ids in prompt]
        raise validation_error(
            "1 validation error:\n  prompt must be a string, a list of strings, a list of "
            "token ids, or a list of lists of token ids",
            "body.prompt",
        )

    def _ids_prompt(self, ids: list[int]) -> _Prompt:
        if any(t < 0 for t in ids):
            raise validation_error(
                "1 validation error:\n  Input should be greater than or equal to 0", "body.prompt"
            )
        return _Prompt(ids, None)

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:  # token ids: their text, as vLLM echoes them
            vocab = self.state.tokenizer.vocab_size
            prompt.text = self.state.tokenizer.decode([t % vocab for t in prompt.ids])
        return prompt.text

    # -------------------------------------------------------------- answers

    async def _answer(self, plan: _Plan, receive: Receive) -> Response:
        if plan.failure == "disconnect" and not plan.body.stream:
            plan.release()
            return _Cut()
        if plan.body.stream:
            return _EventStream(partial(self._stream, plan))
        try:  # queued or running, a client that leaves has its requests aborted
            answered, texts = await unless_disconnected(receive, partial(_collect, plan))
        finally:
            plan.release()
        if not answered or texts is None:
            return _gone()
        return self._whole(plan, texts)

    def _whole(self, plan: _Plan, texts: list[str]) -> Response:
        """A non-streamed response from its choices' texts."""
        for choice in plan.choices:
            if choice.error is not None:
                return _error(ApiError(choice.error))
        body: list[dict[str, Any]] = []
        ids_wanted = bool(plan.body.return_token_ids)
        for choice in plan.choices:
            text = texts[choice.index]
            prompt = plan.prompts[choice.prompt_index]
            output_ids = choice.detokenizer.token_ids
            if plan.chat:
                entry: dict[str, Any] = {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": choice.logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
                if ids_wanted:
                    entry["token_ids"] = output_ids
                body.append(entry)
                continue
            logprobs = choice.logprobs
            if plan.echo:
                text = self._prompt_text(prompt) + text
                logprobs = self._echo_logprobs(plan, prompt, choice)
                output_ids = [*prompt.ids, *output_ids]
            entry = {
                "index": choice.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            if ids_wanted:
                entry["prompt_token_ids"] = prompt.ids
                entry["token_ids"] = output_ids
            body.append(entry)
        response: dict[str, Any] = {
            "id": plan.base,
            "object": "chat.completion" if plan.chat else "text_completion",
            "created": int(time.time()),
            "model": self.state.model_name,
            "choices": body,
            "usage": _usage(plan.prompts),
        }
        if ids_wanted and plan.chat:
            response["prompt_token_ids"] = plan.prompts[0].ids
        return _response(response)

    def _echo_logprobs(self, plan: _Plan, prompt: _Prompt, choice: Choice) -> Any:
        """An echoed prompt's logprobs before the output's (the first token has none,
        as in vLLM), or None without logprobs."""
        k = choice.logprobs_k
        if k is None:
            return None
        tokenizer = self.state.tokenizer
        ids = [t % tokenizer.vocab_size for t in prompt.ids]
        as_ids = bool(plan.body.return_tokens_as_token_ids)
        head = completion_logprobs(tokenizer, ids, -len(ids), k, 0, as_ids)
        head["token_logprobs"][0] = None
        head["top_logprobs"][0] = None
        tail = choice.logprobs
        if isinstance(tail, dict):
            for key, values in tail.items():
                head[key].extend(values)
        return head

    async def _stream(self, plan: _Plan, write: Write) -> None:
        """Write SSE chunks as outputs arrive; the jobs are released (aborted if still
        running) however this ends, a client disconnect (cancellation) included."""
        model = self.state.model_name
        created = int(time.time())
        chat = plan.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        body = plan.body
        continuous = body.continuous_usage
        echo = plan.echo

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": plan.base,
                "object": kind,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + _json.encode(payload) + b"\n\n"

        # A token's chunk is `chunk([choice])` byte for byte, from a prefix and a choice
        # template made once: dicts and a whole encode per token cost more than its write.
        head = chunk([])[: -len(b"]}\n\n")]
        text_field = b'"delta":{"content":%s}' if chat else b'"text":%s'
        no_text = b'"delta":{}' if chat else b'"text":""'
        choice_template = b'{"index":%d,%s,"logprobs":%s,"finish_reason":%s,"stop_reason":%s}'

        def choice_usage(choice: Choice) -> dict[str, Any]:
            prompt_tokens = len(plan.prompts[choice.prompt_index].ids)
            return {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": choice.num_tokens,
                "total_tokens": prompt_tokens + choice.num_tokens,
            }

        ids_wanted = bool(body.return_token_ids)
        started: set[int] = set()  # choices whose first event went out

        def with_ids(choice: Choice, encoded: bytes, new_ids: list[int], first: bool) -> bytes:
            """``return_token_ids``: the event's ids (and, first, the prompt's)."""
            entry = msgspec.json.decode(encoded)
            prompt_ids = plan.prompts[choice.prompt_index].ids
            if first and not chat:
                entry["prompt_token_ids"] = prompt_ids
            entry["token_ids"] = [*prompt_ids, *new_ids] if first and echo else new_ids
            return _json.encode(entry)

        def event(choice: Choice, output: Output) -> bytes:
            """One output's SSE event."""
            before = choice.num_tokens
            text, logprobs = choice.absorb(output, chat=chat)
            if choice.error is not None:
                return b"data: " + _json.encode(ApiError(choice.error).body()) + b"\n\n"
            first = choice.index not in started
            started.add(choice.index)
            if echo and first:
                text = self._prompt_text(plan.prompts[choice.prompt_index]) + text
            field = text_field % _json.encode(text) if text else no_text
            reason, stop_reason = choice.finish_reason, choice.stop_reason
            encoded = choice_template % (
                choice.index,
                field,
                b"null" if logprobs is None else _json.encode(logprobs),
                b"null" if reason is None else _json.encode(reason),
                b"null" if stop_reason is None else _json.encode(stop_reason),
            )
            if ids_wanted:
                encoded = with_ids(choice, encoded, choice.detokenizer.token_ids[before:], first)
            if continuous:
                return chunk([msgspec.json.decode(encoded)], choice_usage(choice))
            return head + encoded + b"]}\n\n"

        try:
            if chat:  # each choice opens with the assistant's role, in a chunk of its own
                role = {"role": "assistant", "content": ""}
                opening = [
                    chunk(
                        [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                    for c in plan.choices
                ]
                if ids_wanted:  # the prompt's ids, in the first chunk ever
                    first_chunk = msgspec.json.decode(opening[0][len(b"data: ") :])
                    first_chunk["prompt_token_ids"] = plan.prompts[0].ids
                    opening[0] = b"data: " + _json.encode(first_chunk) + b"\n\n"
                await write(b"".join(opening), True)
            pending = [c.index for c in plan.choices if not c.finished]
            if plan.failure == "disconnect":  # one event, then the connection is cut
                if not chat and pending:
                    choice = plan.choices[pending[0]]
                    job = plan.jobs[choice.index]
                    assert job is not None
                    await write(event(choice, await job.outputs.receive()), True)
                return
            # Round robin over the choices (every step sends each running one a token).
            # Outputs that queued up while the client was being written to go out in one
            # write: a loaded server catches up instead of falling behind. The last
            # outputs go out with the usage, [DONE] and the end of the response, in one
            # write.
            last = b""
            for index in [c.index for c in plan.choices if c.finished]:  # echo only
                choice = plan.choices[index]
                text = self._prompt_text(plan.prompts[choice.prompt_index]) if plan.echo else ""
                last += chunk(
                    [
                        {
                            "index": index,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": choice.finish_reason,
                            "stop_reason": None,
                        }
                    ]
                )
            choices, jobs = plan.choices, plan.jobs
            while pending:
                for index in list(pending):
                    choice = choices[index]
                    job = jobs[index]
                    assert job is not None
                    outputs = job.outputs
                    try:
                        events = [event(choice, await outputs.receive())]
                        while not choice.finished:
                            events.append(event(choice, outputs.receive_nowait()))
                    except anyio.WouldBlock:
                        pass
                    except anyio.EndOfStream:  # ended without a last output (aborted)
                        pending.remove(index)
                        continue
                    if choice.finished:
                        pending.remove(index)
                        if choice.finish_reason == "stop":
                            job.stopped()
                    if pending:
                        await write(b"".join(events), True)
                    else:
                        last += b"".join(events)
            if body.include_usage:
                last += chunk([], _usage(plan.prompts))
            await write(last + b"data: [DONE]\n\n", False)
        finally:
            plan.release()


async def _collect(plan: _Plan) -> list[str]:
    """Every choice's text, its outputs read to the end (or to its stop, when its
    engine request is ended as finished)."""
    parts: list[list[str]] = [[] for _ in plan.choices]
    for choice, job in zip(plan.choices, plan.jobs, strict=True):
        if job is None:
            continue
        async for output in job.outputs:
            text, logprobs = choice.absorb(output, chat=plan.chat)
            parts[choice.index].append(text)
            choice.gather(logprobs)
            if choice.finished:
                if choice.finish_reason == "stop":
                    job.stopped()
                break
    return ["".join(part) for part in parts]


def _base_id(header_id: str | None, body: SamplingFields, prefix: str) -> str:
    """vLLM's response id: the ``X-Request-Id`` header, else ``request_id``, else a
    random one, after the endpoint's prefix."""
    given = header_id or body.request_id
    return f"{prefix}-{given or uuid.uuid4().hex}"


def _usage(prompts: list[_Prompt]) -> dict[str, Any]:
    """vLLM's usage: each prompt's tokens once (however many choices it has), every
    choice's output tokens, and the prompts' cached tokens (their first choice's)."""
    prompt = sum(len(p.ids) for p in prompts)
    completion = sum(c.num_tokens for p in prompts for c in p.choices)
    cached = sum(p.choices[0].cached for p in prompts if p.choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
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
