"""The manager as a pool-actor extension: its operations as handlers of message kinds.

The actor owns the `BlockPool`; `manager_extension` builds a `KvManager` over it and
returns one `Handler` per message kind of `kvpool.manager.messages`, so request-level
calls are turns of the same actor as the pool's own calls, atomic with respect to them.

Cancellation (the actor's contract, `kvpool.actors.core.Handler`): a call whose caller
left before the actor reached it is skipped. A call the actor already ran whose reply
is never read is *undone* when it handed something to its caller:
- `AllocateSlots`: `KvManager.undo_allocation` releases the blocks it added, leaf
  first, and clips the computed count. Events are not taken back: a BlockRemoved for
  what its reserve evicted stays queued (those hashes really are gone), and blocks
  made visible since stay resident (idle in the LRU), so the router's view stays true.
- `TakeEvents`: the events are put back ahead of newer ones (nothing is lost).
- `AddRequest`: the request is forgotten again if it still holds no block.
`FreeRequest` and `PreemptRequest` give capacity back: they run even if their caller
stopped waiting, and the actor then retries its waiters. `AppendTokens` and
`MarkComputed` take effect if the actor reached them (re-sending the same computed count
is harmless: it is monotonic, not additive).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvpool.actors import WAIT, Extension, Handler, PoolState, Wait
from kvpool.manager.kv_manager import KvManager
from kvpool.manager.messages import (
    AddRequest,
    AllocateSlots,
    AllocationReply,
    AppendTokens,
    CheckManager,
    EventsReply,
    FreeRequest,
    GetManagerStats,
    GetPrefillCost,
    ManagerStatsReply,
    MarkComputed,
    PreemptRequest,
    PrefillCostReply,
    TakeEvents,
)
from kvpool.messages import DoneReply
from kvpool.pool import BlockPool

_DONE = DoneReply()
_NO_ROOM = AllocationReply(None)


class ManagerHandlers:
    """The handlers of one manager over the actor's pool; only the actor calls them."""

    __slots__ = ("manager", "state")

    def __init__(self, state: PoolState, manager: KvManager) -> None:
        self.state = state
        self.manager = manager

    def table(self) -> dict[type[Any], Handler[Any, Any]]:
        """The manager protocol's handler table."""
        return {
            AllocateSlots: Handler(self.allocate, undo=self.undo_allocate, waits=_waits),
            MarkComputed: Handler(self.mark_computed),
            AppendTokens: Handler(self.append_tokens),
            AddRequest: Handler(self.add_request, undo=self.undo_add_request),
            FreeRequest: Handler(self.free, gives_back=True),
            PreemptRequest: Handler(self.preempt, gives_back=True),
            GetPrefillCost: Handler(self.prefill_cost),
            TakeEvents: Handler(self.take_events, undo=self.undo_take_events),
            GetManagerStats: Handler(self.stats),
            CheckManager: Handler(self.check_invariants),
        }

    def allocate(self, message: AllocateSlots) -> AllocationReply | Wait:
        allocation = self.manager.allocate(
            message.request_id, message.num_tokens, cache=message.cache
        )
        if allocation is None:
            self.state.record_reserve(None)
            return WAIT if message.wait else _NO_ROOM
        if allocation.block_ids:  # an allocation with no new block reserved nothing
            self.state.record_reserve(allocation.removed)
        return AllocationReply(allocation)

    def undo_allocate(self, message: AllocateSlots, reply: AllocationReply) -> None:
        if reply.allocation is not None:
            self.manager.undo_allocation(message.request_id, reply.allocation)

    def mark_computed(self, message: MarkComputed) -> DoneReply:
        self.manager.mark_computed(message.request_id, message.num_computed_tokens)
        return _DONE

    def append_tokens(self, message: AppendTokens) -> DoneReply:
        self.manager.append_tokens(message.request_id, message.token_ids)
        return _DONE

    def add_request(self, message: AddRequest) -> DoneReply:
        self.manager.add_request(message.request_id, message.prompt_token_ids)
        return _DONE

    def undo_add_request(self, message: AddRequest, reply: DoneReply) -> None:
        manager = self.manager
        if message.request_id in manager and not manager.num_blocks(message.request_id):
            manager.free(message.request_id)

    def free(self, message: FreeRequest) -> DoneReply:
        self.manager.free(message.request_id)
        return _DONE

    def preempt(self, message: PreemptRequest) -> DoneReply:
        self.manager.preempt(message.request_id)
        return _DONE

    def prefill_cost(self, message: GetPrefillCost) -> PrefillCostReply:
        return PrefillCostReply(self.manager.prefill_cost(message.request_id))

    def take_events(self, message: TakeEvents) -> EventsReply:
        return EventsReply(self.manager.take_events())

    def undo_take_events(self, message: TakeEvents, reply: EventsReply) -> None:
        self.manager.restore_events(reply.events)

    def stats(self, message: GetManagerStats) -> ManagerStatsReply:
        pool = self.manager.pool
        return ManagerStatsReply(
            self.manager.stats(), pool.num_active(), pool.num_inactive(), pool.capacity
        )

    def check_invariants(self, message: CheckManager) -> DoneReply:
        self.manager.check_invariants()
        return _DONE


def _waits(message: AllocateSlots) -> bool:
    return message.wait


def manager_extension(
    block_size: int,
    *,
    enable_prefix_caching: bool = True,
    medium: str | None = "GPU",
    on_create: Callable[[KvManager], None] | None = None,
) -> Extension:
    """An extension that runs a `KvManager` over the actor's pool.

    ``on_create`` receives the manager once the actor builds it (for tests and for
    in-process inspection; drive it only through the actor). The arguments are checked
    here, before any actor starts: raises `InvalidArgumentError` for a bad one.
    """
    # Validate now with a throwaway pool, so a bad argument fails at the call site.
    KvManager(BlockPool(1), block_size, enable_prefix_caching=enable_prefix_caching, medium=medium)

    def extension(state: PoolState) -> Mapping[type[Any], Handler[Any, Any]]:
        manager = KvManager(
            state.pool, block_size, enable_prefix_caching=enable_prefix_caching, medium=medium
        )
        if on_create is not None:
            on_create(manager)
        return ManagerHandlers(state, manager).table()

    return extension


__all__ = ["ManagerHandlers", "manager_extension"]
