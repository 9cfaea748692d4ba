"""examples/events_and_hashing.py runs for real (a ZMQ publisher on loopback included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "events_and_hashing.py"


def test_events_example_hashes_publishes_and_replays() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=True
    )
    lines = result.stdout.splitlines()
    # The NOTES' golden local hash of tokens 0..15; block 1 is chained from it.
    assert lines[0] == "sequence hashes: [15310707395893867146, 13769157705258532664]"
    assert "events: ['BlockStored']" in lines
    assert "subscriber got 1 event(s)" in lines
    assert lines[-1] == "replayed sequence 0: True"
