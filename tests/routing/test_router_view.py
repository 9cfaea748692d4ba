"""A KV-aware router's view, built only from the manager's encoded events, stays exact.

The indexer (`router_view.RouterView`, in tests/support) is what a router keeps
(hash -> parent) and checks what real routers rely on: a parent is stored before its
child, Removed names only stored hashes, a resident hash is never stored twice, and each
BlockStored's token ids re-hash to its block hashes. A seeded multi-request scheduler
with chunked prefill, decode, LIFO preemption and a pool small enough to evict drives the
manager; after every step's flush the view must equal the pool's resident hashes.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_view import RouterView

from kvpool.events import (
    decode_batch,
    encode_batch,
)
from kvpool.manager import KvManager, ManagerStats
from kvpool.pool import BlockPool

BLOCK_SIZE = 4


@dataclass
class Workload:
    """A tiny vLLM-style scheduler: chunked prefill, decode, LIFO preemption."""

    seed: int
    capacity: int = 24
    max_running: int = 4
    enable_prefix_caching: bool = True
    cache_on_allocate: bool = False  # vLLM's allocate_slots: visible when scheduled
    rng: random.Random = field(init=False)
    manager: KvManager = field(init=False)
    view: RouterView = field(init=False)
    universe: set[int] = field(default_factory=set)
    waiting: deque[str] = field(default_factory=deque)
    running: list[str] = field(default_factory=list)
    outputs_left: dict[str, int] = field(default_factory=dict)
    flushes: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.manager = KvManager(
            BlockPool(self.capacity),
            BLOCK_SIZE,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        self.view = RouterView(BLOCK_SIZE)
        # A few shared "system prompts" of unaligned lengths, so prefixes are reused.
        self.families = [
            [self.rng.randrange(50) for _ in range(self.rng.randrange(3, 22))] for _ in range(4)
        ]

    def run(self, steps: int) -> None:
        for step in range(steps):
            if self.rng.random() < 0.6:
                self._arrive(f"r{step}")
            self._serve_running()
            self._admit_waiting()
            self._flush(float(step))

    def _arrive(self, request_id: str) -> None:
        rng = self.rng
        prompt = rng.choice(self.families) + [rng.randrange(50) for _ in range(rng.randrange(14))]
        self.manager.add_request(request_id, prompt)
        self.outputs_left[request_id] = rng.randrange(1, 12)
        self.waiting.append(request_id)

    def _serve_running(self) -> None:
        manager = self.manager
        for request_id in list(self.running):
            if request_id not in self.running:  # preempted earlier in this step
                continue
            computed = manager.num_computed_tokens(request_id)
            total = manager.num_tokens(request_id)
            if computed == total:
                if not self.outputs_left[request_id]:
                    manager.free(request_id)
                    self.running.remove(request_id)
                    continue
                manager.append_tokens(request_id, [self.rng.randrange(50)])
                self.outputs_left[request_id] -= 1
                total += 1
            target = min(total, computed + self.rng.randrange(1, 9))
            while manager.allocate(request_id, target, cache=self.cache_on_allocate) is None:
                victim = self.running.pop()  # LIFO: the newest running request
                manager.preempt(victim)
                self.waiting.appendleft(victim)
                if victim == request_id:
                    break
            else:
                self._compute(request_id, target)

    def _admit_waiting(self) -> None:
        manager = self.manager
        while self.waiting and len(self.running) < self.max_running:
            request_id = self.waiting[0]
            cost = manager.prefill_cost(request_id)
            start = cost.cached_blocks * BLOCK_SIZE
            target = min(manager.num_tokens(request_id), start + self.rng.randrange(1, 12))
            allocation = manager.allocate(request_id, target, cache=self.cache_on_allocate)
            if allocation is None:
                return
            assert allocation.cached_blocks == cost.cached_blocks
            computed = target if self.cache_on_allocate else start
            assert manager.num_computed_tokens(request_id) == computed
            self.waiting.popleft()
            self.running.append(request_id)
            self._compute(request_id, target)

    def _compute(self, request_id: str, num_tokens: int) -> None:
        self.manager.mark_computed(request_id, num_tokens)
        self.universe.update(self.manager.block_hashes(request_id))

    def _flush(self, ts: float) -> None:
        batch = self.manager.take_batch(ts, data_parallel_rank=0)
        if batch is not None:
            self.view.apply(decode_batch(encode_batch(batch)))
            self.flushes += 1
        pool = self.manager.pool
        resident = {h for h in self.universe if pool.prefix_hit(h) is not None}
        assert set(self.view.parents) == resident
        self.manager.check_invariants()
        # The manager is the pool's only user: its tables hold every reference.
        assert pool.num_active_refs() == sum(self.manager.num_blocks(r) for r in self.manager)


def _total(stats: list[ManagerStats]) -> tuple[int, int, int]:
    return (
        sum(s.evictions for s in stats),
        sum(s.preemptions for s in stats),
        sum(s.prefix_hit_tokens for s in stats),
    )


@pytest.mark.parametrize("cache_on_allocate", [False, True])
def test_router_view_equals_resident_hashes_under_a_busy_workload(cache_on_allocate: bool) -> None:
    stats = []
    for seed in range(8):
        workload = Workload(seed, cache_on_allocate=cache_on_allocate)
        workload.run(250)
        stats.append(workload.manager.stats())
        assert workload.flushes > 0
    evictions, preemptions, hit_tokens = _total(stats)
    # The workload really exercised what the view must survive.
    assert evictions > 0
    assert preemptions > 0
    assert hit_tokens > 0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(12, 40),
    max_running=st.integers(1, 6),
    cache_on_allocate=st.booleans(),
)
def test_router_view_invariants_hold_for_any_seed(
    seed: int, capacity: int, max_running: int, cache_on_allocate: bool
) -> None:
    Workload(
        seed, capacity=capacity, max_running=max_running, cache_on_allocate=cache_on_allocate
    ).run(120)


@pytest.mark.parametrize("seed", [0, 1])
def test_without_prefix_caching_the_router_sees_nothing(seed: int) -> None:
    workload = Workload(seed, enable_prefix_caching=False)
    workload.run(150)
    assert workload.flushes == 0
    assert workload.view.parents == {}
    assert workload.manager.stats().preemptions > 0
