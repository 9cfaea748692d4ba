"""Deterministic logprobs for the mock's tokens, in vLLM's completions and chat shapes.

The mock does not sample, so it makes the distribution up, consistently: at output
position ``i`` the sampled token ``t`` is the most likely one, with probability
``p = 0.5 + 0.5 u`` where ``u`` is a hash of ``(t, i)`` in [0, 1); the next most likely
are ``t + 1, t + 2, ...`` (mod the vocabulary) with probabilities ``(1 - p) / 2**j``,
so the top list is sorted and the probabilities sum to at most 1. Equal requests get
equal logprobs; none is above 0.
"""

from __future__ import annotations

import math
from typing import Any

from kvpool.serve.tokenizer import Tokenizer
from kvpool.workloads import mix_seed

_U32 = 2**32


def top_logprobs(token_id: int, position: int, vocab_size: int, k: int) -> list[tuple[int, float]]:
    """The ``max(k, 1)`` most likely ``(id, logprob)`` at ``position``, the sampled
    ``token_id`` first."""
    p = 0.5 + 0.5 * (mix_seed(token_id, position) / _U32)
    top = [(token_id, math.log(p))]
    rest = 1.0 - p
    top.extend(
        ((token_id + j) % vocab_size, math.log(rest / 2**j)) for j in range(1, min(k, vocab_size))
    )
    return top


def token_text(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs show it: its text, or ``token_id:<id>`` with vLLM's
    ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode_token(token_id)


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    start: int,
    k: int,
    text_offset: int,
    as_ids: bool = False,
) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs`` for output ids at positions ``start, ...``:
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob, the sampled token
    and ``k`` alternatives at most) and ``text_offset`` (from ``text_offset``)."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for i, token_id in enumerate(token_ids):
        top = top_logprobs(token_id, start + i, tokenizer.vocab_size, k)
        text = token_text(tokenizer, token_id, as_ids)
        tokens.append(text)
        values.append(top[0][1])
        tops.append({token_text(tokenizer, t, as_ids): lp for t, lp in top})
        offsets.append(text_offset)
        text_offset += len(tokenizer.decode_token(token_id))
    return {
        "text_offset": offsets,
        "token_logprobs": values,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], start: int, k: int, as_ids: bool = False
) -> list[dict[str, Any]]:
    """vLLM's chat ``logprobs.content`` entries: ``token``, ``logprob``, ``bytes`` and
    the ``k`` most likely alternatives (``top_logprobs``)."""
    content: list[dict[str, Any]] = []
    for i, token_id in enumerate(token_ids):
        top = top_logprobs(token_id, start + i, tokenizer.vocab_size, max(k, 1))
        entries = []
        for t, lp in top[:k]:
            text = token_text(tokenizer, t, as_ids)
            entries.append({"token": text, "logprob": lp, "bytes": list(text.encode())})
        text = token_text(tokenizer, token_id, as_ids)
        content.append(
            {
                "token": text,
                "logprob": top[0][1],
                "bytes": list(text.encode()),
                "top_logprobs": entries,
            }
        )
    return content


__all__ = ["chat_logprobs", "completion_logprobs", "token_text", "top_logprobs"]
