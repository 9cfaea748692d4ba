"""A workload's requests: arrival time, prompt and output, with tokens derived on demand.

A prompt is a tuple of `Segment`s (a seed and a length); its tokens are a pure function of
the segments, so two prompts that start with the same segments start with the same
tokens and share cache blocks. Tokens are built only when the engine admits a request:
a trace of thousands of long prompts never sits in memory as token lists.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from operator import attrgetter
from typing import NamedTuple

from kvpool.hashing import TOKEN_TYPECODE
from kvpool.hashing.runs import TokenRuns
from kvpool.workloads.tokens import (
    TOKEN_MASK,
    segment_runs,
    segment_token_array,
    segment_tokens,
)

_U64 = (1 << 64) - 1
_LENGTH = attrgetter("length")
_new = object.__new__
_set = object.__setattr__  # a frozen dataclass's fields are set as its __init__ sets them


class Segment(NamedTuple):
    """``length`` tokens derived from ``seed``: token ``j`` is ``(seed + j) mod 2**32``."""

    seed: int
    length: int

    def token(self, index: int) -> int:
        """Token id number ``index`` of the segment (no bounds check: hot path)."""
        return (self.seed + index) & TOKEN_MASK

    def tokens(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Token ids ``[start, stop)`` of the segment (``stop`` defaults to its length).

        Token ``j`` is ``(seed + j) mod 2**32``: consecutive ids from a random u32, so two
        segments share a token run only if their seeds are within a prompt's length of
        each other, and share a whole block at the same depth of a sequence (which is
        what the chained block hashes compare) practically never.
        """
        return segment_tokens(self.seed, self.length, start, self.length if stop is None else stop)


def mix_seed(*parts: int) -> int:
    """A u32 seed from integers (splitmix64 rounds): distinct inputs, unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _U64)) * 0xBF58476D1CE4E5B9 & _U64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _U64
        h ^= h >> 29
    return (h ^ (h >> 32)) & TOKEN_MASK


def seed_mixer(*prefix: int) -> Callable[[int], int]:
    """``mix_seed(*prefix, part)`` as a function of ``part``: the prefix's rounds are
    done once here, so each call makes the last round only (a trace reader seeds every
    request's output from its line number under one domain)."""
    start = 0x9E3779B97F4A7C15
    for part in prefix:
        start = (start ^ (part & _U64)) * 0xBF58476D1CE4E5B9 & _U64
        start = (start ^ (start >> 31)) * 0x94D049BB133111EB & _U64
        start ^= start >> 29

    def mix(part: int) -> int:
        h = (start ^ (part & _U64)) * 0xBF58476D1CE4E5B9 & _U64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _U64
        h ^= h >> 29
        return (h ^ (h >> 32)) & TOKEN_MASK

    return mix


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload.

    ``arrival_s`` is the simulated arrival time in seconds from the workload's start;
    ``prompt`` the prompt's segments; ``output`` the segment the engine generates token by
    token (its length is the number of output tokens, at least 1).
    """

    request_id: str
    arrival_s: float
    prompt: tuple[Segment, ...]
    output: Segment
    input_length: int = field(init=False)

    def __post_init__(self) -> None:
        lengths = list(map(_LENGTH, self.prompt))
        if lengths and min(lengths) < 0:
            raise ValueError(f"request {self.request_id}: negative segment length")
        length = sum(lengths)
        if length < 1:
            raise ValueError(f"request {self.request_id}: the prompt must hold >= 1 token")
        if self.output.length < 1:
            raise ValueError(f"request {self.request_id}: output_length must be >= 1")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival must be >= 0")
        object.__setattr__(self, "input_length", length)

    @classmethod
    def checked(
        cls,
        request_id: str,
        arrival_s: float,
        prompt: tuple[Segment, ...],
        output: Segment,
        input_length: int,
    ) -> RequestSpec:
        """The spec of a caller that has checked what construction checks (no negative
        segment length, a prompt of ``input_length`` >= 1 tokens, an output of >= 1
        and an arrival >= 0) and knows the prompt's length: a trace reader, whose record
        states it. Spares the second reading of every segment that construction makes."""
        spec = _new(cls)
        _set(spec, "request_id", request_id)
        _set(spec, "arrival_s", arrival_s)
        _set(spec, "prompt", prompt)
        _set(spec, "output", output)
        _set(spec, "input_length", input_length)
        return spec

    @property
    def output_length(self) -> int:
        """Tokens the request generates before it finishes."""
        return self.output.length

    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids, built now (a fresh list each call)."""
        return self.prompt_token_array().tolist()

    def prompt_token_runs(self, *, with_tokens: bool = False) -> TokenRuns:
        """The prompt as `TokenRuns`, one run per segment: what the engine hands a KV
        manager that keys blocks by runs (`kvpool.hashing.runs`); no token is built,
        unless ``with_tokens`` (for a manager that keeps them: events carry them)."""
        # a spec's segments were checked when it was made: `TokenRuns.of_checked`
        runs = segment_runs(self.prompt)
        tokens = self.prompt_token_array() if with_tokens else None
        return TokenRuns.of_checked(runs, self.input_length, tokens)

    def prompt_token_array(self) -> array[int]:
        """The prompt's token ids as a fresh ``u32`` array (`TOKEN_TYPECODE`): what the
        engine hands the KV manager, copied from each segment's cached array."""
        tokens = array(TOKEN_TYPECODE)
        for segment in self.prompt:
            tokens.extend(_segment_array(segment))
        return tokens


@lru_cache(maxsize=4096)
def _segment_array(segment: Segment) -> array[int]:
    """A segment's tokens as a ``u32`` array, shared: callers copy it, never change it.

    Prompts of a trace repeat their segments (a conversation's history, a system
    prompt), soon after they first appear: on the multi-turn trace 1,024 entries miss
    no more than a million would; 4,096 of Mooncake's 512-token segments hold 8 MiB.
    """
    return segment_token_array(segment.seed, segment.length)
