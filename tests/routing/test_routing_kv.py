"""Dynamo's KV router rule on hand-made cases: the logit, ties, softmax, prefill and
active-block bookkeeping, the approximate (TTL) mode, and its config's field names."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.routing import KvRouter, KvRouterConfig, RouterSettings, WorkerLoad, prompt_hashes
from kvpool.workloads import RequestSpec, Segment

BS = 4


def spec(rid: str, *segments: tuple[int, int], at: float = 0.0) -> RequestSpec:
    return RequestSpec(rid, at, tuple(Segment(s, n) for s, n in segments), Segment(9, 1))


def loads(n: int = 3) -> list[WorkerLoad]:
    return [WorkerLoad(i, 0, 0, 0, 100) for i in range(n)]


def router(n: int = 3, seed: int = 0, **config: object) -> KvRouter:
    return KvRouter(RouterSettings(num_workers=n, block_size=BS, seed=seed, config=config))


def stored(request: RequestSpec, blocks: int | None = None) -> BlockStored:
    hashes = prompt_hashes(request, BS)[:blocks]
    tokens = request.prompt_token_ids()[: len(hashes) * BS]
    return BlockStored(hashes, None, tokens, BS)


def test_the_worker_holding_the_prefix_wins_at_equal_load() -> None:
    # 16 tokens = 4 blocks. Empty worker: prefill 16/4 - 0 = 4, decode 0 + 4 = 4 -> 8;
    # worker 1 holds all 4: prefill max(0, 4 - 4) = 0, decode 4 -> 4.
    r = router()
    request = spec("a", (100, 16))
    r.observe(1, [stored(request)], 0.0)
    assert r.choose(request, loads(), 0.0) == 1
    assert r.overlap_seen("a") == 4


def test_active_blocks_outweigh_a_short_overlap() -> None:
    # Worker 0 holds 1 block of the prompt but already decodes 3 routed requests of 4
    # private blocks each (12 active): logit 0 = (4 - 1) + (12 + 3 new + 1... ) > 8.
    r = router(n=2)
    for i in range(3):
        r._pick = lambda logits: 0  # type: ignore[method-assign]
        r.choose(spec(f"busy{i}", (1000 * (i + 1), 16)), loads(2), 0.0)
    del r._pick
    request = spec("b", (100, 16))
    r.observe(0, [stored(request, blocks=1)], 0.0)
    # worker 0: prefill (3 * 16 pending + 16) / 4 - 1 = 15, decode 12 + 4 = 16 -> 31
    # worker 1: prefill 16 / 4 = 4, decode 4 -> 8
    assert r.choose(request, loads(2), 0.0) == 1


def test_a_finished_request_releases_its_blocks_and_prefill() -> None:
    r = router(n=2)
    r._pick = lambda logits: 0  # type: ignore[method-assign]
    r.choose(spec("x", (1000, 16)), loads(2), 0.0)
    state = r._workers[0]
    assert len(state.refs) == 4
    assert state.prefill_tokens == 16
    r.finished(0, "x", 1.0)
    assert state.refs == {}
    assert state.prefill_tokens == 0
    assert state.pending == {}


def test_prefill_ends_when_its_last_block_is_stored() -> None:
    r = router(n=2)
    r._pick = lambda logits: 0  # type: ignore[method-assign]
    request = spec("p", (500, 18))  # 4 full blocks and a 2-token tail
    r.choose(request, loads(2), 0.0)
    state = r._workers[0]
    assert state.prefill_tokens == 18
    r.observe(0, [stored(request, blocks=3)], 0.1)  # a first chunk: still prefilling
    assert state.prefill_tokens == 18
    r.observe(0, [stored(request)], 0.2)
    assert state.prefill_tokens == 0
    assert len(state.refs) == 5  # still decoding: 4 blocks and its tail


def test_shared_active_blocks_are_counted_once() -> None:
    r = router(n=1)
    r.choose(spec("s1", (7, 16)), loads(1), 0.0)
    r.choose(spec("s2", (7, 16)), loads(1), 0.0)
    assert len(r._workers[0].refs) == 4
    assert r._workers[0].refs[prompt_hashes(spec("s1", (7, 16)), BS)[0]] == 2


def test_ties_at_temperature_zero_are_drawn_and_reproducible() -> None:
    picks = [router(seed=seed)._pick([5.0, 5.0, 7.0]) for seed in range(200)]
    assert set(picks) == {0, 1}
    assert picks == [router(seed=seed)._pick([5.0, 5.0, 7.0]) for seed in range(200)]
    assert router()._pick([3.0, 1.0, 2.0]) == 1


def test_softmax_draws_with_dynamo_rescaled_probabilities() -> None:
    # logits [0, 1, 1], temperature 0.5: range 1, weights exp(-(l - 0) / 0.5)
    r = router(router_temperature=0.5, seed=3)
    draws = Counter(r._pick([0.0, 1.0, 1.0]) for _ in range(6000))
    weights = [1.0, math.exp(-2.0), math.exp(-2.0)]
    for i, weight in enumerate(weights):
        assert draws[i] / 6000 == pytest.approx(weight / sum(weights), abs=0.02)
    assert Counter(r._pick([4.0, 4.0]) for _ in range(2000))[0] == pytest.approx(1000, abs=100)


def test_events_remove_and_clear_what_the_view_holds() -> None:
    r = router(n=2)
    request = spec("e", (100, 16))
    hashes = prompt_hashes(request, BS)
    r.observe(1, [stored(request), BlockRemoved(hashes[2:3])], 0.0)
    assert r._workers[1].view.overlap(hashes) == 2  # type: ignore[call-arg]
    r.observe(1, [AllBlocksCleared()], 0.0)
    assert r._workers[1].view.overlap(hashes) == 0  # type: ignore[call-arg]


def test_the_approximate_mode_predicts_from_its_own_decisions_for_ttl() -> None:
    r = router(use_kv_events=False, router_ttl_secs=10.0)
    assert not r.uses_kv_events
    first = r.choose(spec("t1", (100, 16), at=0.0), loads(), 0.0)
    r.finished(first, "t1", 1.0)
    assert r.choose(spec("t2", (100, 16), at=5.0), loads(), 5.0) == first
    assert r.overlap_seen("t2") == 4
    r.finished(first, "t2", 6.0)
    r.choose(spec("t3", (100, 16), at=16.0), loads(), 16.0)  # 11 s after t2: expired
    assert r.overlap_seen("t3") == 0


def test_config_takes_dynamo_field_names() -> None:
    assert KvRouterConfig.from_mapping({"overlap_score_weight": 2.0}).prefill_load_scale == 2.0
    assert KvRouterConfig.from_mapping({"overlap_score_weight": None}).prefill_load_scale == 1.0
    config = KvRouterConfig.from_mapping({"router_temperature": 0.3, "use_kv_events": False})
    assert (config.router_temperature, config.use_kv_events) == (0.3, False)
    with pytest.raises(InvalidArgumentError, match="router_queue_threshold only at"):
        KvRouterConfig.from_mapping({"router_queue_threshold": 2})
    with pytest.raises(InvalidArgumentError, match="does not model router_bogus"):
        KvRouterConfig.from_mapping({"router_bogus": 2})
    # a config written for Dynamo: tier weights (no tiers here) and defaults pass
    dynamo = {"host_cache_hit_weight": 0.5, "router_queue_policy": "fcfs", "router_ttl_secs": 9}
    assert KvRouterConfig.from_mapping(dynamo).router_ttl_secs == 9
    with pytest.raises(InvalidArgumentError, match="true or false"):
        KvRouterConfig.from_mapping({"use_kv_events": 1})
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        KvRouterConfig.from_mapping({"router_temperature": -1})


def test_overlap_weight_zero_routes_by_load_alone() -> None:
    r = router(n=2, overlap_score_weight=0.0)
    request = spec("w", (100, 16))
    r.observe(0, [stored(request)], 0.0)
    r._pick = lambda logits: 0  # type: ignore[method-assign]
    r.choose(spec("busy", (900, 16)), loads(2), 0.0)  # worker 0: 4 active blocks
    del r._pick
    # cached or not, worker 0 costs decode 4 + 4 = 8, worker 1 costs 4
    assert r.choose(request, loads(2), 0.0) == 1


def test_dynamo_s_own_default_config_is_accepted() -> None:
    llm = pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime ships Linux wheels only")
    import inspect

    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(llm.KvRouterConfig).parameters.items()
    }
    assert KvRouterConfig.from_mapping(defaults) == KvRouterConfig()
