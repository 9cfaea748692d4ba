"""The dispatch module: the plain policies as objects choose as their bound fast paths do,
and `make_policy` names them."""

from __future__ import annotations

import zlib

import pytest

from kvpool.engine import EngineConfig, LeastLoaded, LocalKvClient, MockEngine, RoundRobin
from kvpool.engine.dispatch import RoutedDispatch, bind, make_policy, worker_load
from kvpool.errors import InvalidArgumentError
from kvpool.workloads import RequestSpec, Segment

pytestmark = pytest.mark.anyio


def spec(request_id: str, prompt: int = 20) -> RequestSpec:
    prompt_seed = zlib.crc32(request_id.encode())
    return RequestSpec(request_id, 0.0, (Segment(prompt_seed, prompt),), Segment(7, 3))


def fleet(n: int) -> list[MockEngine]:
    return [
        MockEngine(LocalKvClient.create(16, 16), EngineConfig(num_gpu_blocks=16), rank=r)
        for r in range(n)
    ]


def test_make_policy_names_the_plain_policies_and_passes_a_policy_through() -> None:
    assert type(make_policy("least-loaded")) is LeastLoaded
    assert type(make_policy("round-robin")) is RoundRobin
    policy = LeastLoaded()
    assert make_policy(policy) is policy
    with pytest.raises(InvalidArgumentError, match="unknown dispatch policy 'random'"):
        make_policy("random")


@pytest.mark.parametrize("policy", [LeastLoaded, RoundRobin])
async def test_a_plain_policy_chooses_as_its_bound_fast_path(policy: type) -> None:
    # the same policy, once bound (heap or counter) and once as a router reading loads
    fast, slow = fleet(4), fleet(4)
    fast_dispatch = bind(policy(), fast)
    slow_dispatch = RoutedDispatch(policy(), slow, event_delay_s=0.0)
    assert not isinstance(fast_dispatch, RoutedDispatch)
    # uneven loads: some engines already hold requests
    for engines in (fast, slow):
        for i, engine in enumerate(engines):
            for k in range(3 - i % 3):
                assert await engine.submit(spec(f"pre{i}.{k}"))
    chosen: list[tuple[int, int]] = []
    for n in range(12):
        a = fast_dispatch.choose(spec(f"r{n}"), 0.0)
        b = slow_dispatch.choose(spec(f"r{n}"), 0.0)
        chosen.append((a, b))
        assert await fast[a].submit(spec(f"r{n}"))
        assert await slow[b].submit(spec(f"r{n}"))
        fast_dispatch.changed(a)
        slow_dispatch.changed(b)
    assert all(a == b for a, b in chosen), chosen
    if policy is RoundRobin:
        assert [a for a, _ in chosen] == [n % 4 for n in range(12)]
    else:  # ties by lowest index: the engines holding fewest first
        assert chosen[0][0] == 2


def test_a_worker_load_reads_the_engine_as_it_stands() -> None:
    engine = fleet(1)[0]
    load = worker_load(3, engine)
    assert (load.index, load.num_running, load.num_waiting) == (3, 0, 0)
    assert (load.active_blocks, load.capacity) == (0, 16)
