"""The profile-guided build's workload (build_support/pgo_workload.py) still runs.

setup.py builds the compiled modules from a profile of that script, and builds them
without one (a warning in pip's log, 10-15% slower simulations) if it fails: only this
test notices when a change to the package breaks it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from kvpool.workloads import MooncakeTrace

WORKLOAD = Path(__file__).resolve().parents[2] / "build_support" / "pgo_workload.py"


def load_workload() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pgo_workload", WORKLOAD)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_workload_runs_to_its_end_as_the_build_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, str(WORKLOAD)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("trained")
    assert "TraceWarning" not in done.stderr  # its trace is well formed


def test_its_trace_is_multi_turn_and_well_formed(tmp_path: Path) -> None:
    path = tmp_path / "multiturn.jsonl"
    load_workload().write_multiturn_trace(path, sessions=40, rate=1.0, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hash id for two block sizes would warn
        with MooncakeTrace(path) as trace:
            requests = list(trace)
    prompts = [request.prompt_token_runs().runs for request in requests]
    # turns share prefixes: some prompt begins with the whole of an earlier one's full
    # blocks, and the requests outnumber the sessions
    assert len(requests) > 40
    assert any(
        later[: len(earlier) - 1] == earlier[:-1] and len(later) > len(earlier)
        for i, earlier in enumerate(prompts)
        for later in prompts[i + 1 :]
        if len(earlier) > 1
    )
