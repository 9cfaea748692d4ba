"""The OpenAI request bodies as vLLM 0.33's OpenAI server takes them, and its error body.

vLLM's ``completion/protocol.py``, ``chat_completion/protocol.py`` and
``sampling_params.py`` are the authority, in their order: the body is parsed laxly
(``"0.5"`` is a float, ``5.0`` an int: msgspec's ``strict=False``, close to pydantic's
lax mode), a wrong type or a before-validator's refusal is a 400 of pydantic's shape
(``type: "Bad Request"``, ``param: "body.<field>"`` or the validator's field); then the
model is checked (`check_model`: none or empty means the served model, another is a 404
``NotFoundError``); then the sampling ranges (`SamplingFields.check_ranges`, 400
``BadRequestError``). Unknown fields are ignored, as vLLM ignores them.

Every field vLLM accepts is either honoured or refused: `unsupported` names the first
one a request sets to something the mock cannot do (400 naming it). Sampling knobs
(``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties, ``seed``) are checked
against vLLM's ranges and change nothing: the mock does not sample, its text is a
function of the prompt (and the choice index), which every value of them allows.
"""

from __future__ import annotations

import math
import re
from http import HTTPStatus
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

import msgspec

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when a request omits it (vLLM's completions default; used for chat
too, where vLLM would fill the context: a mock should answer briefly by default)."""

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""
MAX_N = 16_384
"""``VLLM_MAX_N_SEQUENCES``."""
MAX_COMPLETION_PROMPTS = 1024
"""``VLLM_MAX_COMPLETION_PROMPTS``: prompts in one completions batch."""
MAX_STOP_STRINGS = 4
"""``VLLM_MAX_STOP_STRINGS``."""
_SAMPLING_EPS = 1e-5
_INT64 = 2**63

Stop: TypeAlias = str | list[str] | None
Prompt: TypeAlias = str | list[str | int | list[int]]
"""A ``/v1/completions`` prompt once parsed: text, token ids, or a batch of either
(`CompletionRequest.prompt` is decoded untyped and checked by the app, which tells the
shapes apart)."""


class ApiError(Exception):
    """A request the server refuses: becomes vLLM's ``ErrorResponse`` with ``status``.

    ``type`` defaults to what vLLM's ``create_error_response`` names the status
    (``BadRequestError``, ``NotFoundError``, ...; the HTTP phrase otherwise)."""

    _TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        500: "InternalServerError",
        501: "NotImplementedError",
    }

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or self._TYPES.get(status) or HTTPStatus(status).phrase
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's body: ``{"error": {"message", "type", "param", "code"}}``, ``code``
        the HTTP status as an int."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def validation_error(message: str, param: str | None) -> ApiError:
    """A refusal while parsing the body: what vLLM's ``RequestValidationError`` handler
    sends (``type`` is the phrase ``Bad Request``)."""
    return ApiError(message, type=HTTPStatus.BAD_REQUEST.phrase, param=param)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both endpoints share, with vLLM's types and defaults."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: int | None = None
    stop: Stop = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    session_id: str | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    return_tokens_as_token_ids: bool | None = None
    # render endpoints' fields, which vLLM's generation endpoints ignore
    routed_experts_prompt_start: int = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None

    @property
    def stop_strings(self) -> list[str]:
        stop = self.stop
        return [] if stop is None else [stop] if isinstance(stop, str) else stop

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return bool(self.stream and options is not None and options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return bool(self.stream and options is not None and options.continuous_usage_stats)

    def output_limit(self) -> int:
        """The requested output length (before the context-length check)."""
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def check_ranges(self, max_tokens: int) -> None:
        """``SamplingParams._verify_args``: vLLM's ranges, its messages and params."""
        n = self.choices
        if n < 1:
            raise ApiError(f"n must be at least 1, got {n}.")
        if n > MAX_N:
            raise ApiError(f"n must be at most {MAX_N}, got {n}.")
        penalties = (("presence_penalty", self.presence_penalty), ("frequency_penalty",
                     self.frequency_penalty))  # fmt: skip
        for name, value in penalties:
            if value is not None and not -2.0 <= value <= 2.0:
                raise ApiError(f"{name} must be in [-2, 2], got {value}.")
        repetition = self.repetition_penalty
        if repetition is not None and not (math.isfinite(repetition) and repetition > 0):
            raise ApiError(f"repetition_penalty must be greater than zero, got {repetition}.")
        temperature = 1.0 if self.temperature is None else self.temperature
        if not math.isfinite(temperature):
            raise ApiError(
                f"temperature must be a finite number, got {temperature}.", param="temperature"
            )
        if not 0.0 <= temperature <= 2.0:
            raise ApiError(
                f"temperature must be in [0, 2], got {temperature}.", param="temperature"
            )
        top_p = 1.0 if self.top_p is None else self.top_p
        if not 0.0 < top_p <= 1.0:
            raise ApiError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        if self.top_k is not None and self.top_k < -1:
            raise ApiError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ApiError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not -_INT64 <= self.seed < _INT64:
            raise validation_error(f"seed must be a 64-bit integer, got {self.seed}", "body.seed")
        if max_tokens < 1:
            raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if self.min_tokens < 0:
            raise ApiError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.min_tokens > max_tokens:
            raise ApiError(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {self.min_tokens}."
            )
        if any(not s for s in self.stop_strings):
            raise ApiError("stop cannot contain an empty string.")
        if n > 1 and temperature < _SAMPLING_EPS:
            raise ApiError(f"n must be 1 when using greedy sampling, got {n}.")
        if self.routed_experts_prompt_start < 0:
            raise validation_error(
                "1 validation error:\n  Input should be greater than or equal to 0",
                "body.routed_experts_prompt_start",
            )
        if self.priority != 0:
            raise ApiError("Priority scheduling is not enabled.", param="priority")

    def sample_logprobs(self) -> int | None:
        """How many top alternatives each output token's logprobs carry (None: no
        logprobs)."""
        raise NotImplementedError

    def check_logprobs(self, vocab_size: int) -> None:
        """vLLM's ``_validate_logprobs`` (-1 asks for the whole vocabulary)."""
        wanted = self.sample_logprobs()
        if wanted == -1:
            wanted = vocab_size
        if wanted is not None and wanted > MAX_LOGPROBS:
            raise ApiError(
                f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                param="logprobs",
            )


_COMMON_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("use_beam_search", "beam search"),
    ("logit_bias", "logit bias"),
    ("allowed_token_ids", "restricted vocabularies"),
    ("bad_words", "bad words"),
    ("logprob_token_ids", "logprobs of chosen tokens"),
    ("prompt_logprobs", "prompt logprobs"),
    ("truncate_prompt_tokens", "prompt truncation"),
    ("structured_outputs", "structured outputs"),
    ("watermarking", "watermarking"),
    ("return_weight_versions", "weight versions"),
    ("cache_salt", "cache salts"),
    ("kv_transfer_params", "KV transfer"),
    ("ec_transfer_params", "encoder-cache transfer"),
    ("vllm_xargs", "extension arguments"),
    ("repetition_detection", "repetition detection"),
    ("thinking_token_budget", "thinking budgets"),
)


def _is_set(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def unsupported(body: SamplingFields, extra: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse (400 naming the field) the first field set to something the mock cannot
    honour."""
    for name, what in (*_COMMON_UNSUPPORTED, *extra):
        if _is_set(getattr(body, name)):
            raise ApiError(
                f"{name}: kvpool serve's mock engine does not support {what}", param=name
            )
    format_ = body.response_format
    if format_ is not None and format_.get("type", "text") != "text":
        raise ApiError(
            "response_format: kvpool serve's mock engine only produces text",
            param="response_format",
        )
    if body.stream_interval not in (None, 1):
        raise ApiError("stream_interval: kvpool serve streams every token", param="stream_interval")
    if not body.spaces_between_special_tokens:
        raise ApiError(
            "spaces_between_special_tokens: kvpool serve decodes with its tokenizer's spacing only",
            param="spaces_between_special_tokens",
        )


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: Any = None  # a `Prompt`, shapes checked by the app
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True

    def sample_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None  # no media: nothing to pass
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    def output_limit(self) -> int:
        """vLLM's order: ``max_completion_tokens``, then the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().output_limit()

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_CHAT_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("tools", "tool calling"),
    ("echo", "echoing the last message"),
    ("continue_final_message", "continuing the final message"),
    ("documents", "documents"),
    ("chat_template", "chat templates"),
    ("return_prompt_text", "returning the prompt text"),
)
_COMPLETION_UNSUPPORTED: tuple[tuple[str, str], ...] = (
    ("suffix", "suffixes"),
    ("prompt_embeds", "prompt embeddings"),
)

_Body = TypeVar("_Body", bound=SamplingFields)
_LOCATION = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)`$")


def _load(body: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise validation_error(f"1 validation error:\n  JSON decode error: {exc}", "body") from None
    if not isinstance(data, dict):
        raise validation_error(
            "1 validation error:\n  Input should be a valid dictionary or object", "body"
        )
    return data


def _convert(data: dict[str, Any], kind: type[_Body]) -> _Body:
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _LOCATION.search(text)
        path = match.group(1) if match else ""
        param = "body" + re.sub(r"\[(\d+)\]", r".\1", path)
        raise validation_error(f"1 validation error:\n  {text}", param) from None


def _must_be_number(data: dict[str, Any], *names: str) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and (isinstance(value, str) or not isinstance(value, int | float)):
            raise validation_error(f"`{name}` must be an integer.", name)


def _check_stream_options(data: dict[str, Any]) -> None:
    if data.get("stream_options") and not data.get("stream"):
        raise validation_error(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    stop = data.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise validation_error(
            f"1 validation error:\n  List should have at most {MAX_STOP_STRINGS} items "
            f"after validation, not {len(stop)}",
            "body.stop",
        )


def parse_completion(body: bytes) -> CompletionRequest:
    """A completions body, parsed and checked as vLLM's ``CompletionRequest`` is."""
    data = _load(body)
    _must_be_number(data, "prompt_logprobs", "logprobs")
    logprobs = data.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise validation_error("`logprobs` must be a positive value or -1.", "logprobs")
    _check_stream_options(data)
    prompt = data.get("prompt")
    if (prompt is None or prompt == "") and not data.get("prompt_embeds"):
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    if (
        isinstance(prompt, list)
        and len(prompt) > MAX_COMPLETION_PROMPTS
        and not all(isinstance(p, int) for p in prompt)
    ):
        raise validation_error(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}.",
            "prompt",
        )
    if data.get("max_tokens") is None:
        data["max_tokens"] = DEFAULT_MAX_TOKENS
    request = _convert(data, CompletionRequest)
    return request


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """A chat body, parsed and checked as vLLM's ``ChatCompletionRequest`` is."""
    data = _load(body)
    _must_be_number(data, "prompt_logprobs", "top_logprobs")
    top = data.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise validation_error("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise validation_error(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
    _check_stream_options(data)
    if "messages" not in data:
        raise validation_error("1 validation error:\n  Field required", "body.messages")
    return _convert(data, ChatCompletionRequest)


def check_model(body: SamplingFields, served: str) -> None:
    """vLLM's ``_check_model``: no model (or an empty one) is the served model; any
    other name is a 404."""
    if body.model and body.model != served:
        raise ApiError(
            f"The model `{body.model}` does not exist. Valid aliases: {served}.",
            status=404,
            param="model",
        )


def check_completion(body: CompletionRequest) -> None:
    """What the mock refuses of a completions request, after vLLM's own checks."""
    unsupported(body, _COMPLETION_UNSUPPORTED)


def check_chat(body: ChatCompletionRequest) -> None:
    """What the mock refuses of a chat request, after vLLM's own checks."""
    unsupported(body, _CHAT_UNSUPPORTED)
    choice = body.tool_choice
    if choice not in (None, "none", "auto"):
        raise ApiError(
            "tool_choice: kvpool serve's mock engine does not support tool calling",
            param="tool_choice",
        )
    if not body.add_generation_prompt:
        raise ApiError(
            "add_generation_prompt: kvpool serve's chat template always adds it",
            param="add_generation_prompt",
        )
    if not body.messages:
        raise ApiError("messages must not be empty", param="messages")
    for message in body.messages:
        if isinstance(message.content, list):
            for part in message.content:
                if part.get("type", "text") != "text":
                    raise ApiError(
                        f"messages: kvpool serve's mock engine takes text only, not "
                        f"{part.get('type')!r} content",
                        param="messages",
                    )


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The text a chat turns into: one ``role: content`` line per message, then
    ``assistant:`` (a fixed template, so the same conversation prefix gives the same
    tokens and a follow-up turn hits the cache). List contents keep their text parts."""
    lines = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content)
        lines.append(f"{message.role}: {content or ''}")
    lines.append("assistant:")
    return "\n".join(lines)


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MAX_LOGPROBS",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Prompt",
    "SamplingFields",
    "StreamOptions",
    "chat_prompt",
    "check_chat",
    "check_completion",
    "check_model",
    "parse_chat",
    "parse_completion",
    "validation_error",
]
