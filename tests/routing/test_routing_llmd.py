"""llm-d's default profile on hand-made cases: each scorer, the weights, the picker."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.routing import LlmdRouter, RouterSettings, WorkerLoad, prompt_hashes
from kvpool.workloads import RequestSpec, Segment

BS = 16


def spec(rid: str, tokens: int, seed: int = 100) -> RequestSpec:
    return RequestSpec(rid, 0.0, (Segment(seed, tokens),), Segment(9, 1))


def load(i: int, waiting: int = 0, active: int = 0) -> WorkerLoad:
    return WorkerLoad(i, 0, waiting, active, 100)


def router(n: int = 3, seed: int = 0, **config: object) -> LlmdRouter:
    return LlmdRouter(RouterSettings(num_workers=n, block_size=BS, seed=seed, config=config))


def test_default_weights_are_llm_d_s() -> None:
    assert router().weights == {
        "prefix-cache-scorer": 3.0,
        "queue-scorer": 2.0,
        "kv-cache-utilization-scorer": 2.0,
    }
    assert not router().uses_kv_events


def test_prefix_score_is_the_matched_fraction_of_the_prompt() -> None:
    r = router()
    r._views[2].routed(prompt_hashes(spec("a", 64), BS)[:2])  # 2 of its 4 blocks
    idle = [load(i) for i in range(3)]
    # queue 1 each (all equal), kv 1 - 0 = 1 each; prefix 0, 0, 0.5 -> 3 * 0.5 = 1.5
    assert r.scores(prompt_hashes(spec("a", 64), BS), idle) == [4.0, 4.0, 5.5]
    assert r.choose(spec("a", 64), idle, 0.0) == 2
    assert r.overlap_seen("a") == 2


def test_queue_score_is_min_max_normalised_waiting() -> None:
    r = router()
    hashes = prompt_hashes(spec("q", 64), BS)
    scores = r.scores(hashes, [load(0, waiting=0), load(1, waiting=4), load(2, waiting=2)])
    assert scores == [2.0 * 1 + 2.0, 2.0 * 0 + 2.0, 2.0 * 0.5 + 2.0]


def test_kv_utilization_score_is_one_minus_usage() -> None:
    r = router(n=2)
    scores = r.scores([], [load(0, active=25), load(1, active=75)])
    assert scores == [pytest.approx(2.0 + 2.0 * 0.75), pytest.approx(2.0 + 2.0 * 0.25)]


def test_a_long_queue_outweighs_half_a_prefix() -> None:
    r = router(n=2)
    r._views[0].routed(prompt_hashes(spec("b", 64), BS)[:2])
    # worker 0: prefix 1.5 + queue 0 + kv 2 = 3.5; worker 1: 0 + 2 + 2 = 4
    assert r.choose(spec("b", 64), [load(0, waiting=3), load(1, waiting=0)], 0.0) == 1


def test_a_pick_indexes_the_prompt_on_that_worker() -> None:
    r = router()
    first = r.choose(spec("c1", 64), [load(i) for i in range(3)], 0.0)
    assert r.choose(spec("c2", 80), [load(i) for i in range(3)], 0.0) == first
    assert r.overlap_seen("c2") == 4


def test_ties_are_drawn_reproducibly() -> None:
    idle = [load(i) for i in range(3)]
    picks = [router(seed=s).choose(spec("t", 64), idle, 0.0) for s in range(60)]
    assert set(picks) == {0, 1, 2}
    assert picks == [router(seed=s).choose(spec("t", 64), idle, 0.0) for s in range(60)]


def test_the_lru_drops_the_least_recently_routed_blocks() -> None:
    r = router(n=1, lruCapacityPerServer=2, blockSize=BS)  # 2 blocks per worker
    r.choose(spec("l1", 64), [load(0)], 0.0)
    assert r._views[0].overlap(prompt_hashes(spec("l1", 64), BS)) == 0  # first 2 gone
    assert r.max_blocks == 256


def test_config_is_checked() -> None:
    assert router(weights={"queue-scorer": 0}).weights["queue-scorer"] == 0.0
    with pytest.raises(InvalidArgumentError, match="weights"):
        router(weights={"session-affinity-scorer": 1})
    with pytest.raises(InvalidArgumentError, match="takes no"):
        router(overlap_score_weight=1)
