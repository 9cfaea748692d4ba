"""The engine's async view of one KV manager, and its in-process implementation.

The engine talks to its cache only through `KvClient`, so the same scheduler runs over a
plain `KvManager` in the engine's task (`LocalKvClient`) or over a manager behind its
own actor (`kvpool.manager.ManagerClient`, which is a `KvClient` as it is). Every method
is a coroutine; what it raises is what `KvManager` raises (a `kvpool.errors.PoolError`,
nothing changed), plus `PoolClosedError` / `PoolCrashedError` for an actor.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from kvpool.events import KVEvent
from kvpool.manager import (
    Allocation,
    KvManager,
    ManagerStats,
    PoolUsage,
    PrefillCost,
    SlotRequest,
    StepAllocations,
    StepOutcome,
    StepUpdate,
)
from kvpool.pool import BlockPool

_T = TypeVar("_T")

KvUsage = PoolUsage
"""The pool's occupancy (`kvpool.manager.PoolUsage`): ``num_active`` blocks in use or
reserved, ``num_inactive`` evictable ones, ``capacity``; ``fraction`` is the KV usage."""


class KvClient(Protocol):
    """What the engine needs from its KV manager: `KvManager`'s calls, awaited.

    Each call returns and raises what the `KvManager` method of the same name does (a
    `kvpool.errors.PoolError` that changed nothing); an actor-backed client also raises
    `PoolClosedError` / `PoolCrashedError` once its actor is gone. Cancellation: an
    in-process client never yields, so a call cannot be interrupted; an actor-backed
    client follows the actor's contract (`kvpool.actors`).
    """

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def capacity(self) -> int:
        """Blocks in the pool."""
        ...

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> PrefillCost:
        """Register a request with its prompt; returns its `prefill_cost` now.

        Raises `DuplicateRequestError` or `InvalidArgumentError`.
        """
        ...

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append generated tokens to a request; returns None.

        Raises `UnknownRequestError` or `InvalidArgumentError`.
        """
        ...

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        """Return the prefix a first allocation would reuse now and what it would need.

        Raises `UnknownRequestError`.
        """
        ...

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        cache: bool = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        """Grow the table to hold ``num_tokens``; return the `Allocation`, or None when
        it does not fit (nothing changed but ``new_tokens``, appended first). With
        ``cache``, also mark ``num_tokens`` computed, making the full blocks they cover
        visible (vLLM's ``allocate_slots``).

        Raises `UnknownRequestError`, `TokenCountError`, `CapacityError`.
        """
        ...

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        """One or more steps' allocations, each ``allocate(..., cache=True,
        new_tokens=...)``, in order until one does not fit (or, with
        ``stop_if_cost_changes``, after the first step that changes ``probe``'s cost
        from it), each step's events drained and counters read after it, and
        ``probe``'s `prefill_cost` after the last: a step whose only KV work is
        allocations needs no `finish_step`, and a run of such steps costs one call
        (`KvManager.allocate_steps`).

        Raises what `allocate` raises, before anything changes.
        """
        ...

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Move the visibility watermark; returns None.

        Raises `UnknownRequestError` or `TokenCountError`.
        """
        ...

    async def free(self, request_id: str) -> None:
        """Release a finished request's blocks leaf first and forget it; returns None.

        Raises `UnknownRequestError`.
        """
        ...

    async def preempt(self, request_id: str) -> None:
        """Release a request's blocks leaf first, keeping its tokens; returns None.

        Raises `UnknownRequestError`.
        """
        ...

    async def take_events(self) -> list[KVEvent]:
        """Drain and return the router-visible events queued so far, oldest first."""
        ...

    async def finish_step(self, updates: list[StepUpdate], probe: str | None = None) -> StepOutcome:
        """Apply a step's updates in order (append, mark, free), then drain the events
        and read the usage and ``probe``'s `prefill_cost`; return them as a `StepOutcome`.

        One call for everything a step does after its schedule. Raises
        `UnknownRequestError` (nothing changed) for an update naming an unknown request
        or an unknown probe; a manager error half-way is a bug in the caller (an
        actor-backed client crashes with `PoolCrashedError`).
        """
        ...

    async def usage(self) -> KvUsage:
        """Return the pool's occupancy now."""
        ...

    async def stats(self) -> ManagerStats:
        """Return the manager's counters (prefix queries and hits, evictions, ...)."""
        ...

    async def check_invariants(self) -> None:
        """Re-derive the manager's and the pool's state; returns None, raises
        `InvariantViolationError` (a bug)."""
        ...


class LocalKvClient:
    """`KvClient` over a `KvManager` owned by the caller's task: calls run inline.

    No method ever yields to the event loop, so a step of the engine is atomic with
    respect to other tasks, and cancellation cannot interrupt a call half-way.
    """

    __slots__ = ("_manager", "_pool")

    def __init__(self, manager: KvManager) -> None:
        self._manager = manager
        self._pool = manager.pool

    @classmethod
    def create(
        cls,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = True,
        run_keys: bool = False,
    ) -> LocalKvClient:
        """A client over a fresh pool of ``num_gpu_blocks`` blocks and its own manager
        (``run_keys``: `KvManager`'s)."""
        manager = KvManager(
            BlockPool(num_gpu_blocks),
            block_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            run_keys=run_keys,
        )
        return cls(manager)

    @property
    def manager(self) -> KvManager:
        """The manager this client drives."""
        return self._manager

    @property
    def block_size(self) -> int:
        return self._manager.block_size

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> PrefillCost:
        return self._manager.add_request(request_id, prompt_token_ids)

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._manager.append_tokens(request_id, token_ids)

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        return self._manager.prefill_cost(request_id)

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        cache: bool = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        return self._manager.allocate(request_id, num_tokens, cache=cache, new_tokens=new_tokens)

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        return self._manager.allocate_steps(steps, probe, stop_if_cost_changes=stop_if_cost_changes)

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        self._manager.mark_computed(request_id, num_computed_tokens)

    async def free(self, request_id: str) -> None:
        self._manager.free(request_id)

    async def preempt(self, request_id: str) -> None:
        self._manager.preempt(request_id)

    async def take_events(self) -> list[KVEvent]:
        return self._manager.take_events()

    async def finish_step(self, updates: list[StepUpdate], probe: str | None = None) -> StepOutcome:
        return self._manager.finish_step(updates, probe)

    async def usage(self) -> KvUsage:
        pool = self._pool
        return KvUsage(pool.num_active(), pool.num_inactive(), pool.capacity)

    async def stats(self) -> ManagerStats:
        return self._manager.stats()

    async def check_invariants(self) -> None:
        self._manager.check_invariants()  # the pool's own invariants included


class TimedKvClient:
    """A `KvClient` wrapper that adds the wall time spent awaiting each call to ``seconds``.

    Benchmarks use it to split wall time between the cache (manager, pool, actor round
    trips) and the scheduler around it.
    """

    __slots__ = ("_inner", "calls", "seconds")

    def __init__(self, inner: KvClient) -> None:
        self._inner = inner
        self.seconds = 0.0
        self.calls = 0

    @property
    def block_size(self) -> int:
        return self._inner.block_size

    @property
    def capacity(self) -> int:
        return self._inner.capacity

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> PrefillCost:
        return await self._timed(self._inner.add_request(request_id, prompt_token_ids))

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        await self._timed(self._inner.append_tokens(request_id, token_ids))

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        return await self._timed(self._inner.prefill_cost(request_id))

    async def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        cache: bool = False,
        new_tokens: Sequence[int] = (),
    ) -> Allocation | None:
        return await self._timed(
            self._inner.allocate(request_id, num_tokens, cache=cache, new_tokens=new_tokens)
        )

    async def allocate_steps(
        self,
        steps: Sequence[Sequence[SlotRequest]],
        probe: str | None = None,
        *,
        stop_if_cost_changes: PrefillCost | None = None,
    ) -> list[StepAllocations]:
        return await self._timed(
            self._inner.allocate_steps(steps, probe, stop_if_cost_changes=stop_if_cost_changes)
        )

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        await self._timed(self._inner.mark_computed(request_id, num_computed_tokens))

    async def free(self, request_id: str) -> None:
        await self._timed(self._inner.free(request_id))

    async def preempt(self, request_id: str) -> None:
        await self._timed(self._inner.preempt(request_id))

    async def take_events(self) -> list[KVEvent]:
        return await self._timed(self._inner.take_events())

    async def finish_step(self, updates: list[StepUpdate], probe: str | None = None) -> StepOutcome:
        return await self._timed(self._inner.finish_step(updates, probe))

    async def usage(self) -> KvUsage:
        return await self._timed(self._inner.usage())

    async def stats(self) -> ManagerStats:
        return await self._timed(self._inner.stats())

    async def check_invariants(self) -> None:
        await self._timed(self._inner.check_invariants())

    async def _timed(self, call: Awaitable[_T]) -> _T:
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1
