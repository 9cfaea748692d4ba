"""examples/pool_basics.py runs as a script and prints the behaviour it describes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pool_basics.py"


def test_pool_basics_example_runs_and_reuses_the_prefix() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stdout.splitlines()
    assert "cache 101: newly visible = True" in lines
    # Capacity 4 holds A's three blocks; B pins two and needs two more: the leaf goes.
    assert "B reserves prefix [101, 102] + 2 fresh, evicting [103]" in lines
    assert lines[-1] == "B done: active=0 inactive=2"
