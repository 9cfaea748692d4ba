"""The actor's examples run for real, as the scripts a user would start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_scheduler_loop_finishes_every_request_and_frees_every_block() -> None:
    out = _run("scheduler_loop.py", "--requests", "60", "--capacity", "48", "--seed", "3")
    finished = re.search(r"finished (\d+) of (\d+) requests in (\d+) steps", out)
    assert finished is not None, out
    assert finished.group(1) == finished.group(2) == "60"
    hit_rate = re.search(r"hit rate (\d+)%", out)
    assert hit_rate is not None
    assert int(hit_rate.group(1)) > 0  # the shared system prompts were reused
    peak = re.search(r"peak (\d+)/48 blocks", out)
    assert peak is not None
    assert 0 < int(peak.group(1)) <= 48
    assert "final: num_active=0 num_active_refs=0" in out


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_the_stress_run_leaves_nothing_held(backend: str) -> None:
    out = _run("stress_run.py", "--clients", "150", "--rounds", "5", "--backend", backend)
    fields = dict(item.split("=") for item in out.split())
    assert (fields["num_active"], fields["num_active_refs"]) == ("0", "0")
    assert int(fields["leases"]) > 0
    # The pool counts every admit that fit, including ones undone for a caller that
    # was cancelled before reading its reply; every lease entered read one of them.
    assert int(fields["reserves"]) >= int(fields["leases"])


@pytest.mark.slow
@pytest.mark.parametrize("router", ["dynamo-indexer", "prefix_router:make"])
def test_the_kv_routed_fleet_sends_each_chat_to_the_worker_holding_its_prefix(
    router: str,
) -> None:
    args = ["--workers", "3", "--chats", "6", "--turns", "3"]
    env = None
    if router == "dynamo-indexer":
        pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime ships Linux wheels only")
    else:  # the plug-in router kvpool simulate runs offline (tests/routing/)
        pytest.importorskip("zmq")
        args += ["--router", router]
        paths = [str(EXAMPLES.parent), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out = _run("kv_routed_fleet.py", *args, env=env)
    turns = re.findall(
        r"chat (\d+) \(system prompt (\d+)\) turn (\d+): worker (\d+), (\d+) of (\d+)", out
    )
    assert len(turns) == 18, out
    worker_of: dict[str, set[str]] = {}
    for chat, system, turn, worker, cached, prompt in turns:
        worker_of.setdefault(system, set()).add(worker)
        if turn != "0":  # the full blocks of the chat's previous prompt, 50 tokens shorter
            assert int(cached) == (int(prompt) - 50) // 16 * 16, out
        elif int(chat) >= 3:  # a later chat on a system prompt already served
            assert int(cached) == 400, out
        else:  # a system prompt nobody holds yet goes to the least-loaded worker
            assert cached == "0", out
    # one worker per system prompt, and the three prompts spread over the three workers
    assert all(len(workers) == 1 for workers in worker_of.values()), out
    assert set().union(*worker_of.values()) == {"1", "2", "3"}, out
    assert "fleet stopped: 3 workers exited 0" in out
