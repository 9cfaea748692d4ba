"""The embedded default workload: shared system prompts and multi-turn chat sessions.

Sessions start as a Poisson process. Each picks a system prompt (popular ones more often,
weights 1/rank) and runs a few turns; turn ``k``'s prompt is the system prompt, every
earlier user message and answer, then a new user message, so a session's context grows
and re-hits its own earlier blocks, and sessions on one system prompt share it. A turn
arrives a think time after the previous one (open loop: it does not wait for the answer).
Everything is drawn from one seeded generator, so a seed names a workload exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
