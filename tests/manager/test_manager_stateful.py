"""Hypothesis drives the manager with valid calls and mistakes in any order.

After every step the manager's and the pool's invariants hold, a mistake changed
nothing, and a router view fed the decoded events equals the pool's resident hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from router_view import RouterView

from kvpool.errors import PoolError
from kvpool.events import decode_batch, encode_batch
from kvpool.manager import AdmissionGate, KvManager, QueuedRequest, SlotRequest
from kvpool.pool import BlockPool

BS = 4
IDS = [f"r{i}" for i in range(5)]
FAMILIES = [[0] * 9, [1, 2, 3, 4] * 2, [5, 5, 6], [0] * 4 + [7] * 5]
TOKENS = st.builds(  # shared prompt families: prefix hits and duplicate copies are common
    lambda family, tail: family + tail,
    st.sampled_from(FAMILIES),
    st.lists(st.integers(0, 3), max_size=7),
)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KvManager(BlockPool(8), BS)
        self.view = RouterView(BS)
        self.universe: set[int] = set()

    # ------------------------------------------------------------- helpers

    def snapshot(self) -> tuple[object, ...]:
        manager, pool = self.manager, self.manager.pool
        tables = {
            r: (manager.block_table(r), manager.num_tokens(r), manager.num_computed_tokens(r))
            for r in manager
        }
        return (pool.num_active(), pool.num_inactive(), tables, manager.num_pending_events)

    def attempt(self, call: Callable[[], Any]) -> Any:
        """Run ``call``; if it raises a PoolError, check that it changed nothing."""
        before = self.snapshot()
        stats = self.manager.stats()
        try:
            return call()
        except PoolError:
            assert self.snapshot() == before
            assert self.manager.stats() == stats
            return None

    def learn(self, request_id: str) -> None:
        if request_id in self.manager:
            self.universe.update(self.manager.block_hashes(request_id))

    # --------------------------------------------------------------- rules

    @rule(request_id=st.sampled_from(IDS), tokens=TOKENS)
    def add_request(self, request_id: str, tokens: list[int]) -> None:
        self.attempt(lambda: self.manager.add_request(request_id, tokens))
        self.learn(request_id)

    @rule(request_id=st.sampled_from(IDS), tokens=st.lists(st.integers(0, 5), max_size=5))
    def append_tokens(self, request_id: str, tokens: list[int]) -> None:
        self.attempt(lambda: self.manager.append_tokens(request_id, tokens))
        self.learn(request_id)

    @rule(request_id=st.sampled_from(IDS), tokens=TOKENS, share=st.floats(0.3, 1))
    def serve(self, request_id: str, tokens: list[int], share: float) -> None:
        """A scheduler step: admit if new, allocate a share of the tokens, compute them."""
        manager = self.manager
        if request_id not in manager:
            manager.add_request(request_id, tokens)
        target = max(
            manager.num_computed_tokens(request_id), round(share * manager.num_tokens(request_id))
        )
        if self.attempt(lambda: manager.allocate(request_id, target)) is not None:
            manager.mark_computed(request_id, max(target, manager.num_computed_tokens(request_id)))
            self.learn(request_id)

    @rule(
        grown=st.lists(st.tuples(st.sampled_from(IDS), st.integers(0, 5)), max_size=2),
        queued=st.lists(st.tuples(st.sampled_from(IDS), st.none() | TOKENS), max_size=3),
        gate=st.builds(
            AdmissionGate,
            budget=st.integers(0, 24),
            headroom=st.integers(-1, 9),
            watermark=st.integers(0, 1),
            running=st.integers(0, 2),
            seats=st.integers(0, 3),
            chunked=st.booleans(),
            full_sequence=st.booleans(),
        ),
    )
    def schedule(
        self,
        grown: list[tuple[str, int]],
        queued: list[tuple[str, list[int] | None]],
        gate: AdmissionGate,
    ) -> None:
        """A step: running slots (growing by a few new tokens), then admissions, new
        requests registered with their prompts (mistakes too: a duplicate, an unknown
        id, a request holding blocks or named twice, a slot beyond its tokens)."""
        manager = self.manager
        slots = [
            SlotRequest(r, manager.num_tokens(r) + more if r in manager else more, [1] * more)
            for r, more in grown
        ]
        queue = [QueuedRequest(r, tokens) for r, tokens in queued]
        outcome = self.attempt(lambda: manager.schedule(slots, queue, gate))
        for request_id in IDS:
            self.learn(request_id)
        if outcome is not None:
            manager.restore_events(outcome.step.events)  # the call drained them

    @rule(request_id=st.sampled_from(IDS), share=st.floats(0, 1))
    def allocate(self, request_id: str, share: float) -> None:
        """Mostly valid: a share of the request's tokens (unknown ids are mistakes)."""
        total = self.manager.num_tokens(request_id) if request_id in self.manager else 1
        self.attempt(lambda: self.manager.allocate(request_id, round(share * total)))

    @rule(request_id=st.sampled_from(IDS), share=st.floats(0, 1))
    def mark_computed(self, request_id: str, share: float) -> None:
        """Mostly valid: between the computed count and what the blocks can hold."""
        if request_id not in self.manager:
            self.attempt(lambda: self.manager.mark_computed(request_id, 0))
            return
        manager = self.manager
        low = manager.num_computed_tokens(request_id)
        high = min(manager.num_tokens(request_id), manager.num_blocks(request_id) * BS)
        self.attempt(lambda: manager.mark_computed(request_id, low + round(share * (high - low))))
        self.learn(request_id)

    @rule(request_id=st.sampled_from(IDS), offset=st.sampled_from([-1, 1, 5]))
    def misuse_counts(self, request_id: str, offset: int) -> None:
        """Always mistakes for a known request: beyond its tokens, or computed backwards."""
        manager = self.manager
        if request_id not in manager:
            return
        if offset > 0:
            tokens = manager.num_tokens(request_id)
            self.attempt(lambda: manager.allocate(request_id, tokens + offset))
            self.attempt(lambda: manager.mark_computed(request_id, tokens + offset))
        elif manager.num_computed_tokens(request_id):
            computed = manager.num_computed_tokens(request_id)
            self.attempt(lambda: manager.mark_computed(request_id, computed + offset))

    @rule(request_id=st.sampled_from(IDS))
    def free(self, request_id: str) -> None:
        self.attempt(lambda: self.manager.free(request_id))

    @rule(request_id=st.sampled_from(IDS))
    def preempt(self, request_id: str) -> None:
        self.attempt(lambda: self.manager.preempt(request_id))

    # ---------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        """Flush after every step: the router's view equals the resident hashes."""
        batch = self.manager.take_batch(0.0)
        if batch is not None:
            self.view.apply(decode_batch(encode_batch(batch)))
        pool = self.manager.pool
        assert set(self.view.parents) == {
            h for h in self.universe if pool.prefix_hit(h) is not None
        }
        self.manager.check_invariants()
        refs = sum(self.manager.num_blocks(r) for r in self.manager)
        assert self.manager.pool.num_active_refs() == refs


ManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_manager_state_machine = ManagerMachine.TestCase
