"""Ctrl-C on trio, wherever it lands: in the actor's own code, in a caller between posting
and parking, in a handler, in a client's bookkeeping (tests/support/interrupt_trials.py states
what every trial must end with).

trio raises KeyboardInterrupt at any bytecode of code that is not KI-protected, from its
SIGINT handler. Here that handler runs for real: a trace function raises SIGINT at the
n-th line the actor package executes, for n spread over a whole run, so the interrupt
lands at chosen points of every function on the path; then real signals, at random
moments, in a subprocess (bounded: a few dozen trials).
"""

from __future__ import annotations

import json
import linecache
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvpool.actors

trio = pytest.importorskip("trio")

from interrupt_trials import check, run_trial  # noqa: E402

ACTOR_DIR = os.path.dirname(kvpool.actors.__file__)
ROUNDS = 3
POINTS = 60  # interrupt points per sweep
HERE = Path(__file__).resolve().parent
PATHS = [str(HERE.parents[1]), str(HERE.parent / "support")]  # the repository, the helpers


def _interrupt_at_line(target: int | None, counted: list[int]) -> Callable[[], None]:
    """Start tracing the actor package; at its ``target``-th line, raise SIGINT (then
    trio's handler decides, as for a real signal at that bytecode). ``counted``
    receives the number of lines seen."""

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            counted[0] += 1
            if counted[0] == target:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.startswith(ACTOR_DIR):
            return local
        return None

    def start() -> None:
        sys.settrace(tracer)

    return start


def _interrupt_after_posting(nth: int) -> Callable[[], None]:
    """Raise SIGINT at the ``nth`` line a call runs right after posting its message
    (between the post and the park: where a caller's Ctrl-C once left its slot live)."""
    seen = [0]
    last_lines: dict[int, str] = {}  # frame id -> the source of its last line run

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            previous = last_lines.get(id(frame))
            if previous is not None and "self._post((message, handler, slot))" in previous:
                seen[0] += 1
                if seen[0] == nth:
                    sys.settrace(None)
                    signal.raise_signal(signal.SIGINT)
            last_lines[id(frame)] = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name == "call" and frame.f_code.co_filename.startswith(ACTOR_DIR):
            last_lines.pop(id(frame), None)
            return local
        return None

    def start() -> None:
        sys.settrace(tracer)

    return start


def test_ctrl_c_between_posting_and_parking_ends_as_the_contract_says() -> None:
    previous = sys.gettrace()
    outcomes: dict[str, int] = {}
    try:
        for nth in range(1, 60, 2):
            trial = run_trial(7, ROUNDS, _interrupt_after_posting(nth))
            sys.settrace(None)
            outcome = check(trial)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        sys.settrace(previous)
    assert outcomes.get("open_pool raised KeyboardInterrupt", 0) > 10, outcomes


def _sweep(seed: int) -> dict[str, int]:
    previous = sys.gettrace()
    try:
        counted = [0]
        trial = run_trial(seed, ROUNDS, _interrupt_at_line(None, counted))
        sys.settrace(None)
        assert check(trial) == "not interrupted"
        total = counted[0]
        outcomes: dict[str, int] = {}
        for k in range(POINTS):
            target = 1 + (total * k) // POINTS + seed % 7
            counted = [0]
            trial = run_trial(seed, ROUNDS, _interrupt_at_line(target, counted))
            sys.settrace(None)
            outcome = check(trial)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return outcomes
    finally:
        sys.settrace(previous)


@pytest.mark.parametrize("seed", [1, 2])
def test_ctrl_c_at_chosen_points_ends_as_the_contract_says(seed: int) -> None:
    outcomes = _sweep(seed)
    assert outcomes.get("open_pool raised KeyboardInterrupt", 0) > POINTS // 4, outcomes


def test_real_ctrl_c_under_load_ends_as_the_contract_says() -> None:
    """Two subprocesses of 16 trials each; a breach fails the child (its traceback is
    shown), a hang trips the child's own watchdog."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(PATHS)}
    children = [
        subprocess.Popen(
            [sys.executable, str(HERE.parent / "support" / "interrupt_trials.py"), "16", str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed in (11, 12)
    ]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-4000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert sum(report["outcomes"].values()) == 16
        assert "not interrupted" not in report["outcomes"], report
