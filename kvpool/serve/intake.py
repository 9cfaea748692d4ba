"""What a request body must pass before anything costly is done with it, so that no
request can stall the others (they share one event loop with the engines).

- The body is read within a limit (`RequestLimits.max_request_body_bytes`, by default
  `default_body_bytes` of ``max_model_len``): a declared ``Content-Length`` beyond it
  is refused before a byte of the body is kept, an undeclared (chunked) body as soon as
  it grows beyond it, with 413 and ``Connection: close``, as a reverse proxy would.
  Like nginx's lingering close, the rest of the body is read and dropped for up to
  `LINGER_S` seconds first, so that a client that sends its whole body before reading
  (most do) gets the 413 rather than a reset connection; a client that asked ``Expect:
  100-continue`` is answered at once and never sends it. A client that leaves
  mid-upload is `ClientGone`, not an error to log.
- A big body's batch is counted before its items are even decoded
  (`check_batch_unparsed`, against vLLM's ``VLLM_MAX_COMPLETION_PROMPTS``, which the
  protocol checks again once decoded), and no text prompt longer than the longest
  text a ``max_model_len``-token prompt can be (`MAX_CHARS_PER_TOKEN` characters a
  token) is tokenized (`check_text_length`, `check_text_prompts`).
- A body larger than `OFF_LOOP_BYTES` is decoded, tokenized and expanded on a worker
  thread (`off_loop`): the engines' loop keeps its clock meanwhile (Hugging Face
  tokenizers let go of the interpreter's lock while they work). A smaller one costs
  less than the hop to a thread and is handled inline. Output text needs no thread: it
  is detokenized incrementally, a few tokens at a time, as the outputs arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread
import msgspec
from starlette.requests import ClientDisconnect, Request

from kvpool.serve.protocol import MAX_COMPLETION_PROMPTS, ApiError, Prompt, validation_error

_T = TypeVar("_T")

BODY_BYTES_PER_TOKEN = 64
"""The default body limit is this many bytes a token of ``max_model_len`` (at least
`MIN_MAX_REQUEST_BODY_BYTES`): room for the longest text prompt (`MAX_CHARS_PER_TOKEN`
characters a token) or token-id prompt (at most 11 bytes an id) twice over, and no
more, since a body is parsed holding the interpreter's lock (msgspec: about 14 ms a
MiB of token ids, 23 ms a MiB of one-word chat messages, 50 ms a MiB of one-word batch
prompts, which `check_batch_unparsed` refuses first), a stall for every request
however it is parsed."""
MIN_MAX_REQUEST_BODY_BYTES = 2**20
"""1 MiB (nginx's default ``client_max_body_size``): the least default body limit."""
MAX_CHARS_PER_TOKEN = 32
"""A text longer than ``max_model_len`` times this is refused untokenized: no
tokenizer's ordinary text averages more characters a token."""
LINGER_S = 5.0
"""How long the rest of a refused body is read and dropped before the 413 (nginx's
``lingering_timeout``)."""
OFF_LOOP_BYTES = 64 * 2**10
"""Bodies above this are parsed and tokenized on a worker thread."""


def default_body_bytes(max_model_len: int) -> int:
    """The body limit when none is given: `BODY_BYTES_PER_TOKEN` a token of
    ``max_model_len``, at least `MIN_MAX_REQUEST_BODY_BYTES`."""
    return max(MIN_MAX_REQUEST_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """A server's limits on one request (see the module doc). ``max_request_body_bytes``
    None means `default_body_bytes` of the server's ``max_model_len`` (`for_context`)."""

    max_request_body_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )

    def for_context(self, max_model_len: int) -> RequestLimits:
        """These limits with the body limit settled for ``max_model_len``."""
        if self.max_request_body_bytes is not None:
            return self
        return RequestLimits(default_body_bytes(max_model_len))

    @property
    def body_bytes(self) -> int:
        """The body limit (once settled by `for_context`)."""
        if self.max_request_body_bytes is None:
            raise ValueError("the body limit is not settled: call for_context first")
        return self.max_request_body_bytes


class BodyTooLarge(ApiError):
    """A body beyond `RequestLimits.max_request_body_bytes`: 413, and the connection is
    closed after the answer (the rest of the body is never read)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than the server's limit of {limit} bytes "
            "(--max-request-body-bytes)",
            status=413,
        )


class ClientGone(Exception):
    """The client disconnected before its request was read whole: there is no one to
    answer."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; raises `BodyTooLarge` beyond it (keeping
    nothing if ``Content-Length`` says so) and `ClientGone` if the client leaves
    mid-upload."""
    declared = request.headers.get("content-length")
    chunks: list[bytes] = []
    size = 0
    body = request.stream()
    try:
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if request.headers.get("expect", "").lower() != "100-continue":
                await _drop_rest(body)
            raise BodyTooLarge(limit)
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                await _drop_rest(body)
                raise BodyTooLarge(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


async def _drop_rest(body: AsyncIterator[bytes]) -> None:
    """Read and drop what is left of a refused body, for at most `LINGER_S` seconds."""
    with anyio.move_on_after(LINGER_S):
        async for _ in body:
            pass


def check_text_length(text: str, max_model_len: int, param: str) -> None:
    """Refuse, untokenized, a text too long to be a ``max_model_len``-token prompt."""
    most = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > most:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"the prompt is {len(text)} characters long, more than {most} "
            f"({MAX_CHARS_PER_TOKEN} a token): it was not tokenized.",
            param=param,
        )


class _PromptShape(msgspec.Struct):
    """A completion body with its prompt left undecoded (the rest is skipped)."""

    prompt: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # empty: absent


def check_batch_unparsed(raw: bytes) -> None:
    """Refuse a completion batch surely larger than vLLM's `MAX_COMPLETION_PROMPTS` from
    its raw JSON, before any item is decoded (decoding a million one-word prompts takes the
    interpreter's lock for a quarter of a second). Counts a lower bound of the items:
    a batch of texts has two unescaped quotes an item (a quote after a backslash is
    not counted, escaped or not), a batch of token-id lists one ``[`` an item. Anything
    else, malformed JSON included, is left to the full decode."""
    try:
        shape = msgspec.json.decode(raw, type=_PromptShape)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    prompt = bytes(shape.prompt)
    if not prompt.startswith(b"["):
        return
    first = prompt[1:].lstrip()[:1]
    if first == b'"':
        least = (prompt.count(b'"') - prompt.count(b'\\"')) // 2
    elif first == b"[":
        least = prompt.count(b"[") - 1
    else:
        return  # token ids: one prompt
    if least > MAX_COMPLETION_PROMPTS:
        raise validation_error(  # vLLM's words, once the batch is decoded
            f"prompt list length {least} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}.",
            "prompt",
        )


def check_text_prompts(prompt: Prompt, max_model_len: int) -> None:
    """A completion's text prompts' lengths, before any is tokenized (token ids are
    checked when their request is built)."""
    if isinstance(prompt, str):
        check_text_length(prompt, max_model_len, "prompt")
        return
    for item in prompt:
        if isinstance(item, str):
            check_text_length(item, max_model_len, "prompt")


async def off_loop(size: int, work: Callable[[], _T]) -> _T:
    """``work()``, on a worker thread if ``size`` (a body's bytes) exceeds
    `OFF_LOOP_BYTES`, else inline (cheaper than the hop to a thread)."""
    if size <= OFF_LOOP_BYTES:
        return work()
    return await anyio.to_thread.run_sync(work)


__all__ = [
    "BODY_BYTES_PER_TOKEN",
    "MIN_MAX_REQUEST_BODY_BYTES",
    "LINGER_S",
    "MAX_CHARS_PER_TOKEN",
    "OFF_LOOP_BYTES",
    "BodyTooLarge",
    "ClientGone",
    "RequestLimits",
    "check_batch_unparsed",
    "check_text_prompts",
    "check_text_length",
    "default_body_bytes",
    "off_loop",
    "read_body",
]
