"""The actors: one task owns a service's state and serves msgspec messages, atomically.

The pool actor (`open_pool`) owns a `BlockPool`; the manager actor
(`kvpool.manager.open_manager`) a `KvManager` and its pool; `open_actor` any state. Each
service declares its message kinds once (`kvpool.actors.operation`).

Any number of tasks on one event loop (asyncio, uvloop or trio) share a pool through the
client `open_pool` yields. One actor task owns the pool and every piece of state plugged
into it; handlers run only in that task, one message per turn, so each call is atomic.
A call posts its message to the actor's mailbox, an unbounded anyio memory object stream
(``send_nowait``: posting never blocks and cannot be half done), and waits for the
reply; the actor drains the mailbox in batches (`kvpool.actors.actor`). Example::

    async with open_pool(1024) as pool:
        admission = await pool.admit(chain, extra=1, wait=True)
        await pool.cache_many(list(zip(admission.blocks[admission.cached :], new_hashes)))
        await pool.free(admission.blocks)

**The cancellation contract** (this is its one statement; the rest of kvpool links here):

- Every client call is a checkpoint: it always yields to the event loop, refused or not,
  `Lease.free()` with nothing left included.
- Calls that hand ownership to the caller (reserve, activate_prefix, allocate_*, admit)
  and queries are all or nothing. Made in an already-cancelled scope, they raise the
  cancellation and take no effect. Cancelled later, either the caller gets the result,
  or the actor skips the request (still queued) or undoes it in a later turn (the reply
  arrived but was never read). Every undo is exact: a reservation is cancelled, blocks
  are released leaf first, an activated prefix is pinned again, an allocated copy
  leaves the pool with its unit back in its reservation, and prefix copies the call
  took from the LRU go back to their place in it (not its tail: the call never used
  them). Only a copy another request found meanwhile stays (idle once they release
  it); its unit then comes back from free or evictable capacity, and if the pool has
  none left, the reservation stays one unit short of what its client saw (its next
  allocation past that raises ReservationExhaustedError): keeping the other request's
  block wins. Evictions a call made stay made: those hashes really are gone.
- Calls that give ownership back (release, cancel, free) are posted first and always
  take effect, even in a cancelled scope, so cleanup in a ``finally`` of a cancelled
  task needs no shield for its effect. Made in an already-cancelled scope, a give-back
  takes effect and then raises the cancellation, on every loop (a checkpoint in a
  cancelled scope); so a ``finally`` making several give-backs shields them, as the
  `PoolClient.lease` and `PoolClient.reservation` exits do. A give-back refused before
  it was posted (`WrongLoopError`) changed nothing, the client's bookkeeping included:
  the reservation stays open, the lease keeps its blocks, and their exits still give
  them back.
- A reply nobody will read is given back in a later turn of the actor. Event-carrying
  replies (the manager's take_events, finish_step, allocate_steps; an extension marks
  its own with ``Handler(ordered=True)``) are one ordered stream: the actor serves such
  a call only once every earlier one's caller read its reply or had it undone, and an
  unread reply's events go back ahead of newer ones, so the stream reaches its drainers
  in the order the actor produced it, however many tasks drain it. The rule for a
  reply never read: its events are delivered to the next drain; none is lost or
  repeated.
- cache_private / cache_many are skipped if their caller left before the actor reached
  them; otherwise they took effect.
- admit(wait=False) is an immediate try: it never queues, so it may succeed while a
  larger waiter keeps waiting. admit(wait=True) queues FIFO behind earlier waiters; a
  cancelled waiter leaves the FIFO without a trace.
- Leaving ``open_pool`` (``open_manager``, ``open_actor``) refuses new calls, handles
  everything already queued, then fails the waiters with the actor's `ActorClosedError`
  (`PoolClosedError`, `ManagerClosedError`); later calls raise it too. The actor's mailbox
  streams are closed when it stops (no ResourceWarning).
- A handler that raises a `PoolError` refused its call and changed nothing; anything
  else is a bug (`kvpool.errors`), a CancelledError included, and so is an undo that
  raises, wherever it runs: the actor crashes, every pending and later call in any task
  raises the actor's `ActorCrashedError` (`PoolCrashedError`, `ManagerCrashedError`; its
  ``__cause__`` the bug), and ``open_pool`` raises it.
  Nothing raised in the actor's task escapes it; ``open_pool`` never raises an
  exception group of its own (`kvpool.actors.hosting`).
- Ctrl-C on trio (which raises KeyboardInterrupt at any bytecode of unprotected code)
  never lands in the actor's loop, its handlers, the host's start and close, or a
  call's post, park and bookkeeping: that code is KI-protected
  (`kvpool.actors.slots.interrupt_safe`), so trio delivers the interrupt to the main
  task's next wait. A call interrupted there is abandoned like a cancelled one; the
  actor settles (closed), every waiter is answered, and ``open_pool`` raises what its
  body raised (the KeyboardInterrupt, or the cancellation it caused), never a group.
  A KeyboardInterrupt raised by a handler itself crashes the actor and ``open_pool``
  re-raises it as it is. Code of the caller's own (after a call returned, around an
  ``async with``) is not protected: what an interrupt there leaves held is what the
  caller was handed. On asyncio, Ctrl-C cancels the main task (asyncio.Runner):
  the cancellation rules above apply.
- A client used off its actor's loop (another thread or loop) raises `WrongLoopError`;
  reach the loop with ``anyio.from_thread``.

**Extension API**: plug your own state and message kinds into the same actor, so your
requests are atomic with the pool's. An extension receives the `PoolState` and returns
a handler table; each `Handler` says how its kind runs, is undone and waits::

    class Touch(msgspec.Struct, frozen=True, tag=True):   # wire-ready request
        block_hash: int

    def touch_extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        def touch(msg: Touch) -> int:       # one turn; a PoolError must change nothing
            hit = state.pool.prefix_hit(msg.block_hash)
            return 0 if hit is None else 1 + hit.is_active

        return {Touch: Handler(touch)}

    async with open_pool(64, extensions=[touch_extension]) as pool:
        reply = await pool.call(Touch(h))    # same contract as the built-in calls

`open_actor(handlers)` runs the same machinery over any state, without a pool.
"""

from kvpool.actors.actor import (
    ANY_ACTOR,
    POOL_ACTOR,
    WAIT,
    Actor,
    ActorIdentity,
    Handler,
    Status,
    Wait,
)
from kvpool.actors.client import ActorReservation, ActorReserveOutcome, Lease, PoolClient
from kvpool.actors.hosting import Extension, open_actor, open_pool
from kvpool.actors.operation import Operation, handler_table
from kvpool.actors.pool_operations import PoolState

__all__ = [
    "ANY_ACTOR",
    "POOL_ACTOR",
    "WAIT",
    "Actor",
    "ActorIdentity",
    "ActorReservation",
    "ActorReserveOutcome",
    "Extension",
    "Handler",
    "Lease",
    "Operation",
    "PoolClient",
    "PoolState",
    "Status",
    "Wait",
    "handler_table",
    "open_actor",
    "open_pool",
]
