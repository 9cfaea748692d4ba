"""One choice of a response: its engine outputs turned into text, stops and logprobs.

A `Choice` takes the `Output` s of one engine request in order (`Choice.absorb`) and
keeps what vLLM's output processor keeps: the output's vocabulary ids, its text (through
an `IncrementalDetokenizer`), why it finished (``"length"``; ``"stop"`` with the stop
string or token id as ``stop_reason``) and its logprobs. A ``stop_token_ids`` token ends
the output once ``min_tokens`` tokens exist (the token counts in the usage, its text is
left out unless ``include_stop_str_in_output``); a stop string once more than
``min_tokens`` do. The engine keeps generating until told: the app ends the request
(`EngineDriver.stop`) once its choice has stopped, and /metrics counts it with
``finished_reason="stop"``; one the engine finished first (its last tokens were already
generated, as happens at ``--speedup-ratio 0``) stays counted as ``"length"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.serve.detokenizer import IncrementalDetokenizer
from kvpool.serve.driver import Output
from kvpool.serve.logprobs import chat_logprobs, completion_logprobs
from kvpool.serve.protocol import SamplingFields
from kvpool.serve.tokenizer import Tokenizer


class Choice:
    """The state of one choice (see the module doc)."""

    __slots__ = (
        "_as_ids",
        "_stop_ids",
        "_tokenizer",
        "cached",
        "detokenizer",
        "error",
        "finish_reason",
        "finished",
        "index",
        "logprobs",
        "logprobs_k",
        "plain",
        "prompt_index",
        "stop_reason",
        "text_offset",
    )

    def __init__(
        self,
        index: int,
        prompt_index: int,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        body: SamplingFields,
        *,
        text_offset: int = 0,
    ) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self._tokenizer = tokenizer
        skip = True if body.skip_special_tokens is None else body.skip_special_tokens
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_ids,
            stop=body.stop_strings,
            include_stop=body.include_stop_str_in_output,
            min_tokens=body.min_tokens,
            skip_special_tokens=skip,
        )
        self._stop_ids = frozenset(body.stop_token_ids or ())
        self.logprobs_k = body.sample_logprobs()
        self._as_ids = bool(body.return_tokens_as_token_ids)
        self.logprobs: list[Any] | dict[str, list[Any]] | None = None
        self.text_offset = text_offset  # completions logprobs: where the output text starts
        self.cached = 0
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finished = False  # a finish reason or an error is set
        # no stop strings, stop tokens or logprobs: the per-token fast path
        self.plain = not (self.detokenizer.stop or self._stop_ids or self.logprobs_k is not None)

    @property
    def num_tokens(self) -> int:
        """Output tokens, as vLLM's usage counts them (a stop token included)."""
        return len(self.detokenizer.token_ids)

    def absorb(self, output: Output, *, chat: bool) -> tuple[str, Any]:
        """Take the next engine output; return the text it adds (held back as vLLM
        holds back a possible stop string) and its logprobs in the endpoint's shape
        (None when not asked for)."""
        if output.error is not None:
            self.error = output.error
            self.finished = True
            return "", None
        self.cached = output.cached_tokens
        detokenizer = self.detokenizer
        ids = [self._tokenizer.output_id(t) for t in output.token_ids]
        if self.plain:
            if output.finished:
                self.finish_reason = "length"
                self.finished = True
            return detokenizer.step(ids, output.finished), None
        before = len(detokenizer.token_ids)
        stop_token = None
        if self._stop_ids:
            for i, token_id in enumerate(ids):
                if token_id in self._stop_ids and before + i + 1 >= detokenizer.min_tokens:
                    stop_token = token_id
                    del ids[i + 1 :]
                    break
        stop_string = detokenizer.update(ids, stop_terminated=stop_token is not None)
        if stop_token is not None:
            self.finish_reason, self.stop_reason = "stop", stop_token
        elif stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        elif output.finished:
            detokenizer.finish()
            self.finish_reason = "length"
        self.finished = self.finish_reason is not None
        text = detokenizer.next_text(self.finished)
        kept = detokenizer.token_ids[before:]
        return text, self._logprobs_for(kept, before, chat=chat)

    def _logprobs_for(self, ids: list[int], start: int, *, chat: bool) -> Any:
        k = self.logprobs_k
        if k is None:
            return None
        if chat:
            return {"content": chat_logprobs(self._tokenizer, ids, start, k, self._as_ids)}
        part = completion_logprobs(self._tokenizer, ids, start, k, self.text_offset, self._as_ids)
        self.text_offset += sum(len(self._tokenizer.decode_token(t)) for t in ids)
        return part

    def gather(self, part: Any) -> None:
        """Keep a non-streamed response's logprobs, part after part."""
        if part is None:
            return
        if self.logprobs is None:
            self.logprobs = part
            return
        assert isinstance(self.logprobs, dict)
        for key, values in part.items():
            self.logprobs[key].extend(values)


__all__ = ["Choice"]
