"""A session: requests sent one after another, each a delay after the previous finished.

A trace's request is a session of one turn. A multi-turn session (Dynamo's synthetic
``turns_per_session``) sends its first turn at the session's arrival and each later
turn ``delay_s`` after the previous one finished (or was rejected): a user who reads
the answer, thinks, and asks again. Later turns' own ``arrival_s`` is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import InvalidArgumentError
from kvpool.workloads.spec import RequestSpec


@dataclass(frozen=True, slots=True)
class Session:
    """``first`` arrives at its ``arrival_s``; each of ``rest`` ``delay_s`` after the one
    before it settled."""

    first: RequestSpec
    rest: tuple[RequestSpec, ...] = ()
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.delay_s >= 0 or self.delay_s == float("inf"):
            raise InvalidArgumentError(
                f"session delay must be a finite number >= 0, got {self.delay_s!r}"
            )

    @property
    def num_turns(self) -> int:
        """Requests in the session."""
        return 1 + len(self.rest)

    @property
    def arrival_s(self) -> float:
        """When the first turn arrives."""
        return self.first.arrival_s
