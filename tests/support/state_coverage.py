"""Run a Hypothesis state machine until it has reached every state a test requires.

Generation is random, so one run now and then misses a rare state even though the
generator can reach it. The machine runs again (at most ``rounds`` times in all) until
every required state has been counted, and the caller's assertion fails only if none of
the rounds reached it: still a real check that the generator covers what matters.
"""

from collections import Counter
from collections.abc import Sequence

from hypothesis import settings as Settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


def run_until_covered(
    machine: type[RuleBasedStateMachine],
    settings: Settings,
    coverage: Counter[str],
    required: Sequence[str],
    rounds: int = 5,
) -> list[str]:
    """Run ``machine`` until ``coverage`` counts every name in ``required``; return the
    names still missing after ``rounds`` runs (empty when covered)."""
    coverage.clear()
    for _ in range(rounds):
        run_state_machine_as_test(machine, settings=settings)
        missing = [name for name in required if coverage[name] == 0]
        if not missing:
            break
    return missing
