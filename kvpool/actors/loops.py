"""The actor's event-loop half: ``call`` and the idle sleep, for asyncio and for trio.

A call takes one of two paths. While the actor sleeps on an empty mailbox with nobody
waiting, the calling task takes the actor's turn itself (a *direct turn*): it runs the
handler synchronously, exactly as the actor would (handlers never await and the loop
runs one task at a time). Every ``yield_every``-th direct turn then passes a checkpoint
(a cooperative budget, `kvpool.actors.core.YIELD_EVERY`), on every loop alike. A caller
cancelled there leaves its reply unread, and the actor undoes it as for a posted call.
Otherwise the call is *posted*: it joins the mailbox, wakes the actor and waits on a
reply slot. Either way each call is one atomic turn and turns keep the order in which
they were taken. A direct turn needs no slot and no wake-up, and most need no task
switch, which costs several times the turn itself.

A reply slot is what a posted caller waits on. On asyncio (and uvloop) the slot *is* a
loop future, the cheapest awaitable there; on trio it is a small record whose reply
reschedules the parked task directly. The round trip is written out in one coroutine
per loop because every layer costs a measurable share of a microsecond.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Generator, Mapping
from typing import Any

import sniffio

from kvpool.actors.core import (
    UNDO_HANDLER,
    WAIT,
    YIELD_EVERY,
    Actor,
    Handler,
    Status,
    _Undo,
)
from kvpool.errors import InvalidArgumentError

_OPEN = Status.OPEN


class AsyncioActor(Actor):
    """Loop futures as reply slots and as the idle actor's alarm clock."""

    __slots__ = ("_new_future", "_sleeper")

    def __init__(
        self, handlers: Mapping[type[Any], Handler[Any, Any]], *, yield_every: int = YIELD_EVERY
    ) -> None:
        super().__init__(handlers, yield_every=yield_every)
        self._new_future = asyncio.get_running_loop().create_future
        self._sleeper: asyncio.Future[None] | None = None

    @types.coroutine
    def call(
        self, message: Any, unwrap: Callable[[Any], Any] | None = None
    ) -> Generator[Any, None, Any]:
        # A generator-based coroutine: its bare yield reaches the task with no
        # intermediate awaitable (13% fewer instructions per call than async def).
        handler = self._handlers.get(type(message))
        if not self._idle or handler is None:
            if handler is None or self._status is not _OPEN:
                return (yield from self._refuse(message).__await__())
            return (yield from self._post(message, handler, unwrap).__await__())
        # A direct turn; a checkpoint only when it spends the last of the budget.
        budget = self._budget - 1
        self._budget = budget or self._yield_every
        try:
            reply = handler.handle(message)
        except BaseException as exc:
            error = self._turn_failed(exc)
            if not budget:
                yield
            raise error  # noqa: B904 (the handler's own error, or PoolCrashedError with cause)
        if reply is WAIT:
            slot = self._new_future()
            self._waiters.append((message, slot, handler))
            self._idle = False
            return (yield from self._reply(message, slot, handler, unwrap).__await__())
        if not budget:
            try:
                yield
            except BaseException:
                # Cancelled with the reply unread: give back what the turn handed out.
                if handler.undo is not None:
                    self.give_back(message, reply, handler.undo)
                raise
        return reply if unwrap is None else unwrap(reply)

    async def _post(
        self, message: Any, handler: Handler[Any, Any], unwrap: Callable[[Any], Any] | None
    ) -> Any:
        """Queue the call for the actor and wait for its reply."""
        if self._status is not _OPEN:
            raise self.gone_error()
        slot = self._new_future()
        self._queue.append((message, slot))
        self._wake()
        return await self._reply(message, slot, handler, unwrap)

    async def _reply(
        self,
        message: Any,
        slot: asyncio.Future[Any],
        handler: Handler[Any, Any],
        unwrap: Callable[[Any], Any] | None,
    ) -> Any:
        try:
            reply = await slot
        except BaseException:
            # Torn away while queued or being handled: task.cancel() has already
            # cancelled the future, so the actor sees the call abandoned. Torn away
            # after the actor replied: the reply sits unread in the future.
            if not slot.done():
                slot.cancel()
                self.waiter_left()
            elif slot.cancelled():
                self.waiter_left()
            elif handler.undo is not None and slot.exception() is None:
                self.give_back(message, slot.result(), handler.undo)
            raise
        return reply if unwrap is None else unwrap(reply)

    def _wake(self) -> None:
        sleeper = self._sleeper
        if sleeper is not None:
            self._sleeper = None
            self._idle = False
            if not sleeper.done():
                sleeper.set_result(None)

    async def run(self) -> None:
        # The base loop with the sleep written inline (so no _sleep here): one
        # coroutine less per batch.
        queue = self._queue
        new_future = self._new_future
        while self._status is _OPEN:
            if queue:
                self._drain()
            elif self._dirty:
                self._pump()
            else:
                sleeper = new_future()
                self._sleeper = sleeper
                self._idle = self._direct_turns and not self._waiters
                try:
                    await sleeper
                finally:
                    self._sleeper = None
                    self._idle = False


class _TrioSlot:
    """A parked trio task waiting for its reply; abandoned once trio aborts the wait."""

    __slots__ = ("_abandoned", "_task")

    def __init__(self, task: Any) -> None:
        self._task = task
        self._abandoned = False

    def cancelled(self) -> bool:
        return self._abandoned

    def set_result(self, result: Any, /) -> None:
        _reschedule(self._task, _Value(result))

    def set_exception(self, exception: BaseException, /) -> None:
        _reschedule(self._task, _Error(exception))

    def abort(self, _raise_cancel: Any) -> Any:
        # Trio aborts only a task that is still parked: the actor has not replied.
        self._abandoned = True
        return _SUCCEEDED


# Trio's low-level names, bound on first use (trio is an optional dependency) as module
# globals: the round trip looks each of them up several times.
_reschedule: Any = None
_current_task: Any = None
_wait_task_rescheduled: Any = None
_checkpoint: Any = None
_Value: Any = None
_Error: Any = None
_SUCCEEDED: Any = None


def _bind_trio() -> None:
    global _reschedule, _current_task, _wait_task_rescheduled, _checkpoint
    global _Value, _Error, _SUCCEEDED
    if _reschedule is None:
        import outcome
        import trio

        _reschedule = trio.lowlevel.reschedule
        _current_task = trio.lowlevel.current_task
        _wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled
        _checkpoint = trio.lowlevel.checkpoint
        _Value = outcome.Value
        _Error = outcome.Error
        _SUCCEEDED = trio.lowlevel.Abort.SUCCEEDED


class TrioActor(Actor):
    """Direct task rescheduling: a posted call's reply is delivered by waking its task.

    A trio task the actor has rescheduled is no longer parked, so trio cannot abort its
    wait: a posted caller always reads a delivered reply, and a cancellation lands at
    its next checkpoint. Only a direct turn can leave a reply unread (its checkpoint
    comes after the turn).
    """

    __slots__ = ("_sleeper",)

    def __init__(
        self, handlers: Mapping[type[Any], Handler[Any, Any]], *, yield_every: int = YIELD_EVERY
    ) -> None:
        super().__init__(handlers, yield_every=yield_every)
        _bind_trio()
        self._sleeper: Any = None

    async def call(self, message: Any, unwrap: Callable[[Any], Any] | None = None) -> Any:
        handler = self._handlers.get(type(message))
        if not self._idle or handler is None:
            if handler is None or self._status is not _OPEN:
                return await self._refuse(message)
            return await self._post(message, unwrap)
        # A direct turn; a checkpoint only when it spends the last of the budget.
        budget = self._budget - 1
        self._budget = budget or self._yield_every
        try:
            reply = handler.handle(message)
        except BaseException as exc:
            error = self._turn_failed(exc)
            if not budget:
                await _checkpoint()
            raise error  # noqa: B904 (the handler's own error, or PoolCrashedError with cause)
        if reply is WAIT:
            slot = _TrioSlot(_current_task())
            self._waiters.append((message, slot, handler))
            self._idle = False
            return await self._reply(slot, unwrap)
        if not budget:
            try:
                await _checkpoint()
            except BaseException:
                # Cancelled with the reply unread: give back what the turn handed out.
                if handler.undo is not None:
                    self.give_back(message, reply, handler.undo)
                raise
        return reply if unwrap is None else unwrap(reply)

    async def _post(self, message: Any, unwrap: Callable[[Any], Any] | None) -> Any:
        """Queue the call for the actor and wait for its reply."""
        if self._status is not _OPEN:
            raise self.gone_error()
        slot = _TrioSlot(_current_task())
        self._queue.append((message, slot))
        self._wake()
        return await self._reply(slot, unwrap)

    async def _reply(self, slot: _TrioSlot, unwrap: Callable[[Any], Any] | None) -> Any:
        try:
            reply = await _wait_task_rescheduled(slot.abort)
        except BaseException:
            if slot._abandoned:
                self.waiter_left()
            raise
        return reply if unwrap is None else unwrap(reply)

    def _wake(self) -> None:
        sleeper = self._sleeper
        if sleeper is not None:
            self._sleeper = None
            self._idle = False
            _reschedule(sleeper)

    async def _sleep(self) -> None:
        self._sleeper = _current_task()
        self._idle = self._direct_turns and not self._waiters

        def abort(_raise_cancel: Any) -> Any:
            self._sleeper = None
            self._idle = False
            return _SUCCEEDED

        await _wait_task_rescheduled(abort)


def new_actor(
    handlers: Mapping[type[Any], Handler[Any, Any]], *, yield_every: int = YIELD_EVERY
) -> Actor:
    """An actor for the running event loop (asyncio, uvloop or trio) over ``handlers``;
    ``yield_every`` is its direct turns' cooperative budget (`YIELD_EVERY`)."""
    if _Undo in handlers:
        raise InvalidArgumentError("the undo entry type is reserved")
    table: dict[type[Any], Handler[Any, Any]] = {_Undo: UNDO_HANDLER, **handlers}
    library = sniffio.current_async_library()
    if library == "trio":
        return TrioActor(table, yield_every=yield_every)
    if library == "asyncio":
        return AsyncioActor(table, yield_every=yield_every)
    raise RuntimeError(f"kvpool's actor runs on asyncio or trio, not {library!r}")
