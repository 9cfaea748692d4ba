"""Failure injection for router tests: requests refused or cut as an unhealthy vLLM would.

llm-d's inference simulator has ``--failure-injection-rate`` and ``--failure-types``;
kvpool serve has the same idea in its own flags: ``--failure-rate P`` fails each valid
generation request with probability P (a seeded generator: the same flags give the
same sequence), ``--fail-first N`` fails the first N whatever the rate (retry tests),
and ``--failure-types`` picks the kinds (each failure draws one; ``--fail-first`` takes
them in turn). The bodies are those vLLM 0.33 sends for the status:

- ``rate_limit``: 429, ``type: "Too Many Requests"`` (a ``GracefulHTTPError``);
- ``overloaded``: 503, ``type: "Service Unavailable"``, vLLM's ``QueueOverflowError``
  message (what its admission control sends);
- ``server_error``: 500, ``type: "InternalServerError"`` (vLLM's ``GenerationError``);
- ``disconnect``: the connection closes mid-response: a stream after its first chunk
  (the request really starts, and is aborted), any other response after its headers
  (uvicorn logs one "returned without completing response" line for each).

Requests refused before this point (a bad body, an unknown model) are not failures and
do not count toward ``--fail-first``. Each failure increments
``kvpool:injected_failures_total{type}`` in /metrics.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvpool.serve.protocol import ApiError

FAILURE_TYPES = ("rate_limit", "overloaded", "server_error", "disconnect")
"""Every kind, in the order ``--fail-first`` cycles through them by default."""


class FailureInjector:
    """Decides which requests fail and how (see the module doc)."""

    def __init__(
        self,
        rate: float = 0.0,
        types: Sequence[str] = FAILURE_TYPES,
        *,
        fail_first: int = 0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the failure rate must be in [0, 1], got {rate}")
        if fail_first < 0:
            raise ValueError(f"fail_first must be >= 0, got {fail_first}")
        unknown = sorted(set(types) - set(FAILURE_TYPES))
        if unknown or not types:
            raise ValueError(
                f"failure types must be among {', '.join(FAILURE_TYPES)}, got {list(types)}"
            )
        self.rate = rate
        self.types = tuple(types)
        self.fail_first = fail_first
        self._random = random.Random(seed)
        self._seen = 0

    @property
    def active(self) -> bool:
        return self.rate > 0 or self.fail_first > 0

    def draw(self) -> str | None:
        """The failure of the next request, or None: it is served."""
        self._seen += 1
        if self._seen <= self.fail_first:
            return self.types[(self._seen - 1) % len(self.types)]
        if self.rate > 0 and self._random.random() < self.rate:
            return self._random.choice(self.types)
        return None


def failure_error(kind: str, model: str) -> ApiError:
    """The error a refusing failure kind answers with (not ``disconnect``)."""
    if kind == "rate_limit":
        return ApiError(
            f"Rate limit reached for {model}: too many requests, please retry later.",
            status=429,
        )
    if kind == "overloaded":
        return ApiError(
            "The engine is currently busy and cannot accept new requests. Please try "
            "again later or on a different instance.",
            status=503,
        )
    if kind == "server_error":
        return ApiError("Internal server error", status=500)
    raise ValueError(f"{kind!r} does not answer with an error body")


__all__ = ["FAILURE_TYPES", "FailureInjector", "failure_error"]
