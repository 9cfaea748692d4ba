"""One output's text, decoded as its tokens arrive, with vLLM's stop-string rules.

Modelled on vLLM 0.33's ``vllm/v1/engine/detokenizer.py``: `IncrementalDetokenizer`
keeps the output's token ids and text, checks ``stop`` strings in the new text only
after ``min_tokens`` tokens (truncating the text at the match, the stop string kept only
with ``include_stop_str_in_output``, and dropping any tokens after the one that
completed it), and hands out deltas that hold back ``max(len(stop)) - 1`` characters
until the output finishes, so a stop string split across chunks is never streamed.

Decoding is incremental over a window (the algorithm of ``tokenizers``' ``DecodeStream``
and vLLM's slow path): the text a token adds is ``decode(window + token)`` minus
``decode(window)``, where the window starts at the previous emitted token, and a token
whose text ends in an incomplete UTF-8 character (U+FFFD) adds nothing until a later one
completes it. The window is seeded with the prompt's last ids, so a SentencePiece
piece's leading space survives on the first output token, as it does in vLLM. The
contract: the concatenated deltas equal ``decode(prompt tail + output)`` minus
``decode(prompt tail)`` (`finish` flushes a held-back incomplete character as the
whole decode renders it). The built-in tokenizer's words need no context; its path
skips the window.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Sequence

from kvpool.serve.tokenizer import BuiltinTokenizer, Tokenizer

_CONTEXT_TOKENS = 4
"""Prompt ids that seed the window (enough for any tokenizer's merge context)."""


class IncrementalDetokenizer:
    """The text of one output (see the module doc)."""

    __slots__ = (
        "_emitted",
        "_free",
        "_ids",
        "_prefix",
        "_read",
        "_skip_special",
        "_tokenizer",
        "include_stop",
        "min_tokens",
        "output_text",
        "stop",
        "stop_buffer",
        "token_ids",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._free = isinstance(tokenizer, BuiltinTokenizer)
        self._skip_special = skip_special_tokens
        vocab = tokenizer.vocab_size
        tail = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids = tail if all(0 <= t < vocab for t in tail) else []
        self._prefix = 0  # the window is _ids[_prefix:]; _ids[_prefix:_read] is emitted
        self._read = len(self._ids)
        self.stop = list(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.stop_buffer = max(map(len, self.stop)) - 1 if self.stop and not include_stop else 0
        self.token_ids: list[int] = []
        self.output_text = ""
        self._emitted = 0

    def _decode_next(self, token_id: int) -> str:
        if self._free:
            return self._tokenizer.decode_token(token_id)
        ids = self._ids
        ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(ids[self._prefix : self._read], self._skip_special)
        new_text = decode(ids[self._prefix :], self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing yet, or an incomplete character: wait for more
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        if self._prefix > 64:  # keep the window (and the list) short
            del ids[: self._prefix - _CONTEXT_TOKENS]
            shift = self._prefix - _CONTEXT_TOKENS
            self._prefix -= shift
            self._read -= shift
        return delta

    def update(self, new_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add the output's next ids; return the stop string they completed, if any.

        ``stop_terminated``: the last id is a stop token, kept in ``token_ids`` but left
        out of the text (unless ``include_stop``), as vLLM does with EOS and
        ``stop_token_ids``.
        """
        if not new_ids:
            return None
        skipped = None
        if stop_terminated and not self.include_stop:
            skipped, new_ids = new_ids[-1], new_ids[:-1]
        previous = len(self.token_ids)
        offsets = [len(self.output_text)] if self.stop else None
        for token_id in new_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if offsets is not None:
                offsets.append(len(self.output_text))
        if skipped is not None:
            self.token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.output_text))
        if offsets is None or len(self.token_ids) <= self.min_tokens:
            return None
        check_from = offsets[max(self.min_tokens - previous, 0)]
        found = check_stop_strings(
            self.output_text, len(self.output_text) - check_from, self.stop, self.include_stop
        )
        if found is None:
            return None
        stop_string, truncate_to = found
        stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
        if not self.include_stop:
            stop_end += len(stop_string)
        kept = bisect_left(offsets, stop_end, lo=1)  # tokens up to the one completing it
        del self.token_ids[previous + kept :]
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    def _flush(self) -> str:
        if self._free or self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip_special)
        new_text = decode(self._ids[self._prefix :], self._skip_special)
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    def finish(self) -> None:
        """The output ended by length: add the text of a held-back incomplete character,
        as decoding the whole sequence renders it."""
        self.output_text += self._flush()

    def step(self, new_ids: Sequence[int], finished: bool) -> str:
        """`update`, `finish` when ``finished``, then `next_text`, for an output with no
        stop strings: the per-token path, which keeps no text (the caller does)."""
        self.token_ids.extend(new_ids)
        if self._free:
            decode_token = self._tokenizer.decode_token
            text = "".join([decode_token(t) for t in new_ids])
        else:
            text = "".join([self._decode_next(t) for t in new_ids])
        return text + self._flush() if finished else text

    def next_text(self, finished: bool) -> str:
        """The text not handed out yet, less the stop-string hold-back unless
        ``finished``."""
        end = len(self.output_text) - (0 if finished else self.stop_buffer)
        start = self._emitted
        if start >= end:
            return ""
        self._emitted = end
        return self.output_text[start:end]


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string completed earliest in the last ``new_char_count`` characters and
    the length to truncate the text to (-1: none), or None; vLLM's rule."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return best, (-1 if best_end >= len(output_text) else best_end)
    return best, best_index


__all__ = ["IncrementalDetokenizer", "check_stop_strings"]
