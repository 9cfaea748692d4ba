"""`open_pool` and `open_actor`: run an actor task for the life of an ``async with`` block.

Exceptions: neither context manager raises an exception group of its own. An exception
from the body propagates unchanged. If the actor crashes, the body is cancelled (as a
failing child cancels a task group) and the block raises `PoolCrashedError` whose
``__cause__`` is the bug; if the body itself raised something other than a cancellation
meanwhile, that exception wins.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import anyio

from kvpool.actors.client import PoolClient
from kvpool.actors.core import YIELD_EVERY, Actor, Handler, Status
from kvpool.actors.loops import new_actor
from kvpool.actors.pool_state import PoolState, extension_handlers
from kvpool.pool import BlockPool

Extension: TypeAlias = Callable[[PoolState], Mapping[type[Any], Handler[Any, Any]]]
"""Given the pool actor's state, return handlers for the extension's own message kinds."""


@asynccontextmanager
async def open_pool(
    capacity: int, *, extensions: Sequence[Extension] = (), yield_every: int = YIELD_EVERY
) -> AsyncIterator[PoolClient]:
    """Start a pool actor owning ``BlockPool(capacity)``; yield its client.

    ``extensions`` plug extra message kinds into the same actor (see `kvpool.actors`).
    ``yield_every``: a caller of the idle actor passes a checkpoint once every this many
    calls (a cooperative budget, `YIELD_EVERY`); 1 makes every call a checkpoint.
    Raises InvalidArgumentError for a bad capacity, a bad ``yield_every`` or a message
    kind registered twice.
    Leaving the block handles everything already queued, then fails every waiter and
    every later call with `PoolClosedError`. See the module docstring for exceptions.
    """
    actor: Actor | None = None
    state = PoolState(BlockPool(capacity), lambda: actor.num_waiters if actor else 0)
    actor = new_actor(extension_handlers(state, extensions), yield_every=yield_every)
    async with _hosted(actor):
        yield PoolClient(actor, capacity)


@asynccontextmanager
async def open_actor(
    handlers: Mapping[type[Any], Handler[Any, Any]], *, yield_every: int = YIELD_EVERY
) -> AsyncIterator[Actor]:
    """Start a bare actor over ``handlers`` (any state, no pool); yield it (`Actor.call`).

    Same life cycle, ``yield_every`` and exception rules as `open_pool`.
    """
    actor = new_actor(handlers, yield_every=yield_every)
    async with _hosted(actor):
        yield actor


@asynccontextmanager
async def _hosted(actor: Actor) -> AsyncIterator[None]:
    body_error: BaseException | None = None
    async with anyio.create_task_group() as task_group:
        actor.set_crash_callback(task_group.cancel_scope.cancel)
        task_group.start_soon(_serve, actor)
        try:
            yield
        except BaseException as exc:
            # Kept out of the task group, which would wrap it in an exception group.
            body_error = exc
        finally:
            actor.close()
    if actor.status is Status.CRASHED and (
        body_error is None or isinstance(body_error, anyio.get_cancelled_exc_class())
    ):
        raise actor.gone_error()
    if body_error is not None:
        raise body_error


async def _serve(actor: Actor) -> None:
    # Shielded: the actor must keep serving (e.g. a lease's shielded free on the way out)
    # until the host closes it, even while an enclosing scope is being cancelled.
    with anyio.CancelScope(shield=True):
        await actor.run()
