"""The OpenAI request bodies the server accepts, as msgspec Structs, and its error body.

Decoding validates at the boundary (types, required fields); fields the mock has no use
for (``temperature``, ``top_p``, ``seed``, ...) are accepted and ignored, as unknown
fields are. Semantic checks (the model name, ``max_tokens``, the cache size) are the
app's, since they need the server's configuration.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when a request omits it (OpenAI's completions default; used for chat
too, where vLLM would fill the context: a mock should answer briefly by default)."""

Prompt: TypeAlias = str | list[str | int | list[int]]
"""``/v1/completions`` prompt: text, token ids, or a batch of either (msgspec cannot
tell ``list[str]`` from ``list[int]`` in one union, so the app checks the list is one
of the three shapes)."""


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: Prompt


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]


class ApiError(Exception):
    """A request the server refuses: becomes OpenAI's error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Prompt",
    "StreamOptions",
    "chat_prompt",
]
