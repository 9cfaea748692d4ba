"""The seeded actor fuzzer (tests/support/actor_fuzz.py) in CI: a few seconds per loop.

Every pool and manager call under every cancellation mode, with clean, close-race and
crash endings; each run is checked for hangs, leaks, invariants, warnings and the
event stream's order. benchmarks/fuzz_actor.py runs the same for longer.
"""

from __future__ import annotations

import pytest
from actor_fuzz import MODES, fuzz

pytestmark = pytest.mark.anyio
SEEDS = range(20)


@pytest.mark.slow
async def test_fuzzed_runs_keep_the_contract() -> None:
    counts = await fuzz(SEEDS)
    endings = {run.split()[1] for run in counts.runs if run != "crashed"}
    assert endings == {"clean", "close", "crash"}, counts.runs
    modes = {call.split(" / ")[1] for call in counts.calls}
    assert modes >= set(MODES[:-1]), modes
    assert counts.outcomes["returned"] > 0
    assert counts.outcomes["cancelled"] > 0
