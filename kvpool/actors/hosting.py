"""`open_actor` and `open_pool`: run an actor task for the life of an ``async with`` block.

Neither context manager raises an exception group of its own. An exception from the
body propagates unchanged. If the actor crashes, the body is cancelled (as a failing
child cancels a task group) and the block raises the actor's `ActorCrashedError`
(`PoolCrashedError` for the pool's) whose ``__cause__`` is the bug (a KeyboardInterrupt
or SystemExit raised in the actor's task is re-raised as it is; anything else, a
handler's CancelledError included, is a bug and raises it); if the body itself raised
something other than a cancellation meanwhile, that exception wins. Ctrl-C on trio
never lands in the actor's own code (`kvpool.actors.slots.interrupt_safe`): trio
delivers it to the main task's next wait, and the block raises that KeyboardInterrupt
after the actor settled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import anyio

from kvpool.actors.actor import ANY_ACTOR, POOL_ACTOR, Actor, ActorIdentity, Handler, Status
from kvpool.actors.client import PoolClient
from kvpool.actors.pool_operations import PoolState
from kvpool.actors.slots import current_slots, interrupt_safe
from kvpool.errors import InvalidArgumentError
from kvpool.pool import BlockPool

Extension: TypeAlias = Callable[[PoolState], Mapping[type[Any], Handler[Any, Any]]]
"""Given the pool actor's state, return handlers for the extension's own message kinds."""


@asynccontextmanager
async def open_pool(
    capacity: int, *, extensions: Sequence[Extension] = ()
) -> AsyncIterator[PoolClient]:
    """Start a pool actor owning ``BlockPool(capacity)``; yield its client.

    ``extensions`` plug extra message kinds into the same actor (see `kvpool.actors`).
    Raises `InvalidArgumentError` for a bad capacity or a message kind registered twice.
    Leaving the block handles everything already queued, then fails every waiter and
    every later call with `PoolClosedError`.
    """
    state = PoolState(BlockPool(capacity))
    table = state.table()
    for extension in extensions:
        for kind, handler in extension(state).items():
            if kind in table:
                raise InvalidArgumentError(f"message kind {kind.__name__} is registered twice")
            table[kind] = handler
    async with open_actor(table, identity=POOL_ACTOR) as actor:
        state.count_waiters = lambda: actor.num_waiters
        yield PoolClient(actor, capacity)


@asynccontextmanager
async def open_actor(
    handlers: Mapping[type[Any], Handler[Any, Any]], *, identity: ActorIdentity = ANY_ACTOR
) -> AsyncIterator[Actor]:
    """Start an actor over ``handlers`` (any state they close over); yield it.

    Same life cycle and exception rules as `open_pool`, raising ``identity``'s errors
    (`ActorClosedError` / `ActorCrashedError` by default); send messages with `Actor.call`.
    """
    actor = Actor(handlers, current_slots(), identity)
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as task_group:
            actor.set_crash_callback(task_group.cancel_scope.cancel)
            task_group.start_soon(_serve, actor)
            try:
                yield actor
            except BaseException as exc:
                # Kept out of the task group, which would wrap it in an exception group.
                body_error = exc
            finally:
                actor.close()
    except BaseExceptionGroup as group:
        # The actor task never raises and the body's exception is kept out, so this is
        # the host's own wait for the actor interrupted (Ctrl-C on trio lands there as
        # on any wait): raise that, not a group of ours. The actor still settled first.
        raise _first_leaf(group) from None
    finally:
        actor.dispose()
    if actor.status is Status.CRASHED and (
        body_error is None or isinstance(body_error, anyio.get_cancelled_exc_class())
    ):
        cause = actor.crash_cause
        if isinstance(cause, (KeyboardInterrupt, SystemExit)):
            raise cause  # an interrupt in the actor's task: the host is interrupted too
        raise actor.gone_error()
    if body_error is not None:
        raise body_error


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The group's first exception that is not itself a group."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


@interrupt_safe
async def _serve(actor: Actor) -> None:
    # Shielded: the actor keeps serving (a cancelled task's give-backs, the queued work
    # at close) until the host closes it, even while an enclosing scope is cancelled.
    with anyio.CancelScope(shield=True):
        await actor.run()


# Starting, closing and leaving the actor must not be cut short by Ctrl-C on trio either
# (a close never posted would leave the host waiting for the actor forever).
interrupt_safe(open_actor.__wrapped__)  # type: ignore[attr-defined]
interrupt_safe(open_pool.__wrapped__)  # type: ignore[attr-defined]
