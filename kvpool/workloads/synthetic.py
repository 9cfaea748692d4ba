"""The synthetic workloads: the embedded default (shared system prompts and multi-turn
chat sessions) and Dynamo replay's (`SyntheticSessions`, fixed lengths, prefix groups).

Sessions start as a Poisson process. Each picks a system prompt (popular ones more often,
weights 1/rank) and runs a few turns; turn ``k``'s prompt is the system prompt, every
earlier user message and answer, then a new user message, so a session's context grows
and re-hits its own earlier blocks, and sessions on one system prompt share it. A turn
arrives a think time after the previous one (open loop: it does not wait for the answer).
Everything is drawn from one seeded generator, so a seed names a workload exactly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvpool.errors import InvalidArgumentError
from kvpool.workloads.session import Session
from kvpool.workloads.spec import RequestSpec, Segment, mix_seed

_SYSTEM = 1  # seed domains: system prompts, user messages, answers
_USER = 2
_ANSWER = 3


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """Knobs of the synthetic mix; ranges are inclusive ``(low, high)`` token counts.

    The defaults are `kvpool simulate`'s embedded workload: about 700 requests that, with
    the CLI's default engine flags, fill the pool so blocks get evicted and requests
    preempted, and that simulate in a few seconds of wall time.
    """

    seed: int = 0
    num_sessions: int = 200
    num_system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (256, 1536)
    turns: tuple[int, int] = (1, 6)
    user_tokens: tuple[int, int] = (32, 384)
    output_tokens: tuple[int, int] = (16, 256)
    sessions_per_s: float = 4.0
    mean_think_time_s: float = 3.0

    def requests(self) -> list[RequestSpec]:
        """Every request of the workload, ordered by arrival (ties by session)."""
        rng = random.Random(self.seed)
        systems = [
            Segment(mix_seed(_SYSTEM, self.seed, i), rng.randint(*self.system_prompt_tokens))
            for i in range(self.num_system_prompts)
        ]
        weights = [1.0 / (rank + 1) for rank in range(self.num_system_prompts)]
        requests: list[RequestSpec] = []
        start = 0.0
        for session in range(self.num_sessions):
            start += rng.expovariate(self.sessions_per_s)
            context: list[Segment] = [rng.choices(systems, weights)[0]]
            arrival = start
            for turn in range(rng.randint(*self.turns)):
                user = Segment(
                    mix_seed(_USER, self.seed, session, turn), rng.randint(*self.user_tokens)
                )
                answer = Segment(
                    mix_seed(_ANSWER, self.seed, session, turn),
                    rng.randint(*self.output_tokens),
                )
                context.append(user)
                requests.append(
                    RequestSpec(
                        request_id=f"s{session}-t{turn}",
                        arrival_s=round(arrival, 6),
                        prompt=tuple(context),
                        output=answer,
                    )
                )
                context.append(answer)
                arrival += rng.expovariate(1.0 / self.mean_think_time_s)
        requests.sort(key=lambda request: request.arrival_s)
        return requests


def default_workload(seed: int = 0) -> list[RequestSpec]:
    """The embedded default workload for ``seed``."""
    return SyntheticWorkload(seed=seed).requests()


_PREFIX = 4  # seed domain of the shared prefixes


@dataclass(frozen=True, slots=True)
class SyntheticSessions:
    """Dynamo replay's synthetic workload (``--input-tokens`` ... ``--inter-turn-delay-ms``):
    ``request_count`` sessions of ``turns_per_session`` requests of fixed lengths.

    As Dynamo generates it (measured on its 1.6 offline replay): sessions start at
    ``request_rate`` per second as a Poisson process whose first arrival is at 0, or
    every ``arrival_interval_s`` from 0, or (both None) all at 0 for a closed loop to
    pace; each later turn is sent ``inter_turn_delay_s`` after the previous one
    finished (`Session`). Every turn's prompt is ``input_tokens`` long: with
    ``num_prefix_groups`` > 0, a session picks a group uniformly at random and its
    prompts start with the group's prefix, ``shared_prefix_ratio`` of the prompt
    rounded up to whole blocks of ``block_size`` tokens (as Dynamo's trace blocks are);
    the rest of each prompt is its own. A turn does not repeat the session's earlier
    turns (Dynamo's do not). One generator seeded with ``seed`` draws everything.
    """

    input_tokens: int
    output_tokens: int
    request_count: int
    request_rate: float | None = None
    arrival_interval_s: float | None = None
    turns_per_session: int = 1
    shared_prefix_ratio: float = 0.0
    num_prefix_groups: int = 0
    inter_turn_delay_s: float = 0.0
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "request_count", "turns_per_session"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        groups, ratio = self.num_prefix_groups, self.shared_prefix_ratio
        if type(groups) is not int or groups < 0:
            raise InvalidArgumentError(f"num_prefix_groups must be an int >= 0, got {groups!r}")
        if not 0.0 <= ratio <= 1.0:
            raise InvalidArgumentError(f"shared_prefix_ratio must be in [0, 1], got {ratio!r}")
        if self.request_rate is not None and self.arrival_interval_s is not None:
            raise InvalidArgumentError("request_rate and arrival_interval_s are exclusive")
        rate = self.request_rate
        if rate is not None and not 0 < rate < float("inf"):
            raise InvalidArgumentError(f"request_rate must be a finite number > 0, got {rate!r}")
        for name in ("arrival_interval_s", "inter_turn_delay_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
        if type(self.block_size) is not int or self.block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {self.block_size!r}")

    @property
    def prefix_tokens(self) -> int:
        """Tokens of a group's shared prefix (0 without groups)."""
        if not self.num_prefix_groups:
            return 0
        wanted = self.shared_prefix_ratio * self.input_tokens
        return min(self.input_tokens, math.ceil(wanted / self.block_size) * self.block_size)

    def sessions(self) -> list[Session]:
        """Every session, ordered by arrival."""
        rng = random.Random(self.seed)
        prefix_tokens = self.prefix_tokens
        prefixes = [
            Segment(mix_seed(_PREFIX, self.seed, group), prefix_tokens)
            for group in range(self.num_prefix_groups)
        ]
        own = self.input_tokens - prefix_tokens
        sessions: list[Session] = []
        arrival = 0.0
        for session in range(self.request_count):
            if session:
                if self.request_rate is not None:
                    arrival += rng.expovariate(self.request_rate)
                elif self.arrival_interval_s is not None:
                    arrival = session * self.arrival_interval_s
            head = (rng.choice(prefixes),) if prefixes and prefix_tokens else ()
            turns = []
            for turn in range(self.turns_per_session):
                user = Segment(mix_seed(_USER, self.seed, session, turn), own)
                turns.append(
                    RequestSpec(
                        request_id=f"s{session}-t{turn}",
                        arrival_s=arrival,
                        prompt=head + ((user,) if own else ()),
                        output=Segment(
                            mix_seed(_ANSWER, self.seed, session, turn), self.output_tokens
                        ),
                    )
                )
            sessions.append(Session(turns[0], tuple(turns[1:]), self.inter_turn_delay_s))
        return sessions
