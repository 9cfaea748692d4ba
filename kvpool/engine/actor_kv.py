"""The engine's KV client over the pool actor: a `ManagerClient` plus one step message.

`open_actor_kv` starts a pool actor running a `KvManager` (`kvpool.manager.open_manager`)
and plugs one more message kind into it, `FinishStep`, so everything a step does after
its schedule (appends, watermark moves, frees, the event drain and the usage read) is a
single actor turn instead of one round trip each. Every other call is the
`ManagerClient`'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from kvpool.actors import Handler, PoolState
from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_client import KvUsage, StepOutcome, StepUpdate, apply_step, check_step
from kvpool.errors import InvalidArgumentError, PoolError
from kvpool.events import KVEvent
from kvpool.manager import (
    Allocation,
    KvManager,
    ManagerClient,
    ManagerStats,
    PrefillCost,
    open_manager,
)


class FinishStep(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Apply a step's updates in order, drain the events, read the usage."""

    updates: list[StepUpdate]


class StepFinished(msgspec.Struct, frozen=True, gc=False, tag=True):
    """`FinishStep`'s reply: the drained events and the pool's occupancy after it."""

    events: list[KVEvent]
    num_active: int
    num_inactive: int
    capacity: int


class _ManagerSlot:
    """Receives the actor's `KvManager` when the actor builds it (``on_create``)."""

    __slots__ = ("manager",)

    def __init__(self) -> None:
        self.manager: KvManager | None = None

    def set(self, manager: KvManager) -> None:
        self.manager = manager


def _step_extension(slot: _ManagerSlot) -> Any:
    def extension(state: PoolState) -> Mapping[type[Any], Handler[Any, Any]]:
        def finish(message: FinishStep) -> StepFinished:
            manager = slot.manager
            assert manager is not None, "the manager extension is built first"
            check_step(manager, message.updates)  # a clean refusal: nothing changed yet
            try:
                outcome = apply_step(manager, message.updates)
            except PoolError as exc:
                # Part of the batch may have been applied: that is a bug in the engine,
                # and the actor's contract says a refusal changes nothing, so crash.
                raise RuntimeError(f"a step's updates failed half-way: {exc}") from exc
            usage = outcome.usage
            return StepFinished(
                outcome.events, usage.num_active, usage.num_inactive, usage.capacity
            )

        def undo(message: FinishStep, reply: StepFinished) -> None:
            manager = slot.manager
            assert manager is not None
            manager.restore_events(reply.events)

        return {FinishStep: Handler(finish, undo=undo, gives_back=True)}

    return extension


class ActorKvClient:
    """`KvClient` over a pool actor: the `ManagerClient`'s calls, plus `finish_step`.

    Every method is one actor call (see `kvpool.actors`). Cancellation is the
    `ManagerClient`'s contract; `finish_step` runs anyway once posted (it returns blocks)
    and, if its reply is never read, puts the drained events back.
    """

    __slots__ = ("_call", "_client")

    def __init__(self, client: ManagerClient) -> None:
        self._client = client
        self._call = client.pool.call

    @property
    def client(self) -> ManagerClient:
        """The manager client this adapter drives."""
        return self._client

    @property
    def block_size(self) -> int:
        return self._client.block_size

    @property
    def capacity(self) -> int:
        return self._client.capacity

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Register a request; returns None. Raises as `KvClient.add_request`.
        Cancellation: skipped, or undone (forgotten again while it holds no block)."""
        await self._client.add_request(request_id, prompt_token_ids)

    async def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens; returns None. Raises as `KvClient.append_tokens`.
        Cancellation: skipped if still queued, otherwise it took effect."""
        await self._client.append_tokens(request_id, token_ids)

    async def prefill_cost(self, request_id: str) -> PrefillCost:
        """Return the request's `PrefillCost`. Raises `UnknownRequestError`.
        Cancellation: skipped or simply unread."""
        return await self._client.prefill_cost(request_id)

    async def allocate(
        self, request_id: str, num_tokens: int, *, cache: bool = False
    ) -> Allocation | None:
        """Return the `Allocation`, or None if it does not fit now (never waits).
        Raises as `KvClient.allocate`. Cancellation: skipped, or undone (the blocks it
        added released leaf first; blocks it made visible stay resident, idle)."""
        return await self._client.allocate(request_id, num_tokens, cache=cache)

    async def mark_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """Move the watermark; returns None. Raises as `KvClient.mark_computed`.
        Cancellation: skipped if still queued, otherwise it took effect."""
        await self._client.mark_computed(request_id, num_computed_tokens)

    async def free(self, request_id: str) -> None:
        """Release and forget the request; returns None. Raises `UnknownRequestError`.
        Cancellation: runs anyway once posted."""
        await self._client.free(request_id)

    async def preempt(self, request_id: str) -> None:
        """Release the request's blocks, keeping it; returns None. Raises
        `UnknownRequestError`. Cancellation: runs anyway once posted."""
        await self._client.preempt(request_id)

    async def take_events(self) -> list[KVEvent]:
        """Drain and return the queued events. Cancellation: skipped, or undone (the
        events go back ahead of newer ones)."""
        return await self._client.take_events()

    async def finish_step(self, updates: list[StepUpdate]) -> StepOutcome:
        """Apply a step's updates, drain the events, read the usage, in one actor turn;
        return the `StepOutcome`. Raises `UnknownRequestError` (nothing changed) for an
        unknown request, `PoolCrashedError` if an update fails half-way (a caller bug).
        Cancellation: runs anyway once posted (it returns blocks); if its reply is never
        read, the drained events are put back."""
        reply: StepFinished = await self._call(FinishStep(updates))
        usage = KvUsage(reply.num_active, reply.num_inactive, reply.capacity)
        return StepOutcome(reply.events, usage)

    async def usage(self) -> KvUsage:
        """Return the pool's occupancy. Cancellation: skipped or simply unread."""
        return await self._client.usage()

    async def stats(self) -> ManagerStats:
        """Return the manager's counters. Cancellation: skipped or simply unread."""
        return await self._client.stats()

    async def check_invariants(self) -> None:
        """Check the manager and pool; returns None. A breach crashes the actor
        (`PoolCrashedError`). Cancellation: skipped or simply unread."""
        await self._client.check_invariants()


@asynccontextmanager
async def open_actor_kv(config: EngineConfig, rank: int = 0) -> AsyncIterator[ActorKvClient]:
    """Start a pool actor with a manager sized by ``config``; yield its engine client.

    The actor stops when the block exits (see `kvpool.manager.open_manager`). Raises
    `InvalidArgumentError` for a bad config value.
    """
    if type(rank) is not int or rank < 0:
        raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
    slot = _ManagerSlot()
    async with open_manager(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        extensions=[_step_extension(slot)],
        on_create=slot.set,
    ) as client:
        yield ActorKvClient(client)
