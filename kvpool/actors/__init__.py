"""The pool actor: one task owns a `BlockPool` and serves msgspec messages, atomically.

Any number of tasks on one event loop (asyncio, uvloop or trio) share a pool through the
client `open_pool` yields; each request is handled in one actor turn, so a turn is
atomic. Example::

    async with open_pool(1024) as pool:
        admission = await pool.admit(chain, extra=1, wait=True)
        await pool.cache_many(list(zip(admission.blocks[admission.cached :], new_hashes)))
        await pool.free(admission.blocks)

Cancellation contract (holds at every point: queued, being handled, replied but unread):

- Calls that hand ownership to the caller (reserve, activate_prefix, allocate_*, admit)
  are all or nothing: the caller gets the result, or the actor skips the request (still
  queued) or undoes it (a later turn gives the ownership back). A caller of an idle
  actor takes the turn itself, and every ``yield_every``-th such turn then yields to
  the loop; cancelled there, it leaves its reply unread, which is undone the same way
  (`kvpool.actors.loops`). Undoing gives
  back what the call took: a reservation is cancelled, blocks are released leaf first,
  an activated prefix is pinned again and a spent unit returns to its reservation (for
  ``allocate_cached`` only if a unit can be freed: the copy itself stays cached, idle).
  Evictions a reserve made and hashes that became visible are not taken back.
- admit(wait=False) is an immediate try: it never queues, so it may succeed while a
  larger waiter keeps waiting. admit(wait=True) queues FIFO behind earlier waiters.
- Calls that give ownership back (release, cancel, free) take effect once posted.
- Queries and cache_private / cache_many are skipped if the caller left before the actor
  reached them; otherwise they took effect.
- Posting never blocks. A cancelled waiter leaves the FIFO without a trace.
- Normal exit of ``open_pool`` handles everything queued, then fails waiters and later
  calls with PoolClosedError. A crash (InvariantViolationError or any non-PoolError exception in a
  handler) fails every pending and later call, in any task, with PoolCrashedError (cause
  attached) and makes ``open_pool`` raise PoolCrashedError; it never raises an exception
  group of its own (`kvpool.actors.hosting`).

Scheduling: a posted call always yields (it waits for the actor). A caller of an idle
actor runs its turn synchronously and passes a checkpoint only once every
``yield_every`` such turns (default `YIELD_EVERY` = 32, a cooperative budget as in
tokio): a task calling the pool in a loop still lets others run and sees its
cancellation within that many calls, without paying a task switch per call. The same
holds on asyncio, uvloop and trio. ``open_pool(capacity, yield_every=1)`` makes every
call a checkpoint (trio's every-call rule; the most interleavings for stress tests).

Extension API (for layers below, e.g. the request manager): plug your own state and
message kinds into the same actor, so your requests are atomic with the pool's::

    class Touch(msgspec.Struct, frozen=True, tag=True):   # wire-ready request
        block_hash: int

    class Touched(msgspec.Struct, frozen=True, tag=True):  # wire-ready reply
        ids: list[int]

    def touch_extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        pool = state.pool                    # the actor's BlockPool; your state wraps it

        def touch(msg: Touch) -> Touched:    # one atomic turn; validate before mutating
            outcome = pool.reserve([msg.block_hash], 0)   # PoolError -> caller, no change
            if outcome is None:
                raise CapacityError("...")  # or return a "did not fit" reply
            state.record_reserve(outcome.removed)
            ids = pool.activate_prefix(outcome.reservation)
            pool.cancel(outcome.reservation)
            return Touched(ids)

        def untouch(msg: Touch, reply: Touched) -> None:  # caller never read the reply
            for block_id in reversed(reply.ids):
                pool.release(block_id)

        return {Touch: Handler(touch, undo=untouch)}

    async with open_pool(64, extensions=[touch_extension]) as pool:
        reply = await pool.call(Touch(h))    # same contract as the built-in calls

`Handler` fields: ``handle(msg) -> reply`` (synchronous, one turn; a PoolError other
than InvariantViolationError refuses the request and must change nothing; anything else
crashes the actor); ``undo(msg, reply)`` for calls handing ownership out (run in a
later turn when the caller never reads ``reply``; must not fail); ``gives_back=True`` for
calls returning ownership (run even if the caller left; retries waiters afterwards);
``waits=predicate`` for requests whose handler may return `WAIT` to queue FIFO until a
``gives_back`` call makes room. `open_actor(handlers)` runs the same machinery over any
state, without a pool.
"""

from kvpool.actors.client import ActorReservation, ActorReserveOutcome, Lease, PoolClient
from kvpool.actors.core import WAIT, YIELD_EVERY, Actor, Handler, Status, Wait
from kvpool.actors.hosting import Extension, open_actor, open_pool
from kvpool.actors.pool_state import PoolState

__all__ = [
    "WAIT",
    "YIELD_EVERY",
    "Actor",
    "ActorReservation",
    "ActorReserveOutcome",
    "Extension",
    "Handler",
    "Lease",
    "PoolClient",
    "PoolState",
    "Status",
    "Wait",
    "open_actor",
    "open_pool",
]
