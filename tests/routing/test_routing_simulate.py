"""Routers in ``kvpool simulate``: the flags, the report's routing section, the records'
overlap, determinism per seed, a plug-in, and plain dispatch reading as before."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cli_runs import ROOT, kvpool

EXAMPLES = ROOT / "examples"


def simulate(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    report, records = tmp_path / "report.json", tmp_path / "requests.jsonl"
    done = kvpool(
        "simulate", "--workers", "3", "--sessions", "12", "--no-progress",
        "--json", str(report), "--requests-jsonl", str(records), *args, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    return {"report": json.loads(report.read_text()), "records": lines, "text": done.stdout}


def test_plain_dispatch_reports_no_routing(tmp_path: Path) -> None:
    run = simulate(tmp_path, "--dispatch", "round-robin")
    assert "routing" not in run["report"]
    assert "router_config" not in run["report"]["settings"]
    assert "router_overlap_blocks" not in run["records"][0]
    assert "routing:" not in run["text"]


def test_kv_routing_reports_workers_spread_and_overlaps(tmp_path: Path) -> None:
    run = simulate(tmp_path, "--dispatch", "kv", "--router-config", '{"overlap_score_weight": 2}')
    routing = run["report"]["routing"]
    assert routing["router"] == "kv"
    assert [w["worker"] for w in routing["workers"]] == [0, 1, 2]
    assert sum(w["requests"] for w in routing["workers"]) == len(run["records"])
    assert routing["requests_spread"] >= 1.0
    cached = sum(r["cached_tokens"] for r in run["records"])
    assert routing["prefix_hit_tokens"] == cached > 0
    overlaps = [r["router_overlap_blocks"] for r in run["records"]]
    assert all(isinstance(o, int) for o in overlaps)
    assert sum(overlaps) > 0
    assert "spread (max/min)" in run["text"]


def test_a_router_run_is_the_same_for_the_same_seed(tmp_path: Path) -> None:
    flags = ("--dispatch", "kv", "--router-config", '{"router_temperature": 0.5}')
    first = simulate(tmp_path, *flags, "--seed", "4")["records"]
    assert simulate(tmp_path, *flags, "--seed", "4")["records"] == first


def test_delayed_events_hide_the_cache_from_the_router(tmp_path: Path) -> None:
    run = simulate(tmp_path, "--dispatch", "kv", "--router-event-delay-ms", "1e9")
    assert all(r["router_overlap_blocks"] == 0 for r in run["records"])
    assert run["report"]["routing"]["event_delay_ms"] == 1e9


def test_llm_d_routes(tmp_path: Path) -> None:
    run = simulate(tmp_path, "--dispatch", "llm-d")
    assert run["report"]["routing"]["router"] == "llm-d"
    assert run["report"]["total"]["prefix_cache_hits"] > 0


def test_a_plug_in_router_loads_from_package_module_factory(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLES)])}
    run = simulate(tmp_path, "--dispatch", "prefix_router:make", env=env)
    assert run["report"]["routing"]["router"] == "prefix_router:make"
    assert sum(r["router_overlap_blocks"] for r in run["records"]) > 0


def test_bad_router_flags_are_usage_errors() -> None:
    for args, message in (
        (("--dispatch", "nope"), "invalid choice"),
        (("--dispatch", "no_such_module:make"), "cannot import"),
        (("--dispatch", "kv", "--router-config", "[1]"), "JSON object"),
        (("--dispatch", "kv", "--router-config", '{"bogus": 1}'), "bogus"),
        (("--router-event-delay-ms", "5"), "need a router"),
    ):
        done = kvpool("simulate", "--no-progress", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr, (args, done.stderr)


def test_a_router_dispatches_data_parallel_lockstep_ranks(tmp_path: Path) -> None:
    run = simulate(tmp_path, "--dispatch", "kv", "--data-parallel-lockstep")
    assert run["report"]["routing"]["prefix_hit_tokens"] > 0
    assert {r["worker"] for r in run["records"]} == {0, 1, 2}


def test_a_router_with_the_actor_backend_and_no_fast_forward_routes_the_same(
    tmp_path: Path,
) -> None:
    local = simulate(tmp_path, "--dispatch", "kv", "--kv-backend", "local")["records"]
    stepped = simulate(tmp_path, "--dispatch", "kv", "--no-fast-forward")["records"]
    assert [r["worker"] for r in local] == [r["worker"] for r in stepped]
    assert local == stepped
