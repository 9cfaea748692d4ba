"""Reply slots and the actor's idle sleep, written once per event loop family.

A reply slot is what a caller waits on while its request sits in the mailbox. The actor
sees every slot through the duck-typed `ReplySlot` interface of an asyncio future:
``cancelled()`` (the caller stopped waiting: the slot is abandoned), ``set_result`` and
``set_exception``. On asyncio (and uvloop) the slot *is* a loop future, the cheapest
awaitable there is; on trio it is a small record that reschedules the parked task
directly. ``anyio.Event`` would work on both but costs several times more per call.

`exchange` is the caller's half of one request: post, wait, and if the caller is torn
away after the actor already replied, hand the unread reply back (``give_back``) so the
actor can undo it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import sniffio


class ReplySlot(Protocol):
    """The actor's view of a pending call (an asyncio future has exactly this shape)."""

    def cancelled(self) -> bool:
        """True once the caller stopped waiting; the reply must then not be delivered."""

    def set_result(self, result: Any, /) -> None:
        """Deliver the reply (only while not cancelled, at most once)."""

    def set_exception(self, exception: BaseException, /) -> None:
        """Deliver an error instead of a reply (only while not cancelled, at most once)."""


Undo = Callable[[Any, Any], None]
"""Gives back what ``reply`` handed out for ``message``: ``undo(message, reply)``."""


class Mailbox(Protocol):
    """The actor's side of an exchange."""

    def post(self, message: Any, slot: ReplySlot) -> None:
        """Queue ``message`` with its reply slot and wake the actor (never blocks)."""

    def give_back(self, message: Any, reply: Any, undo: Undo) -> None:
        """The caller of ``message`` will never read ``reply``: have it undone."""

    def waiter_left(self) -> None:
        """A caller stopped waiting before its reply: the FIFO may move on."""


class Backend(Protocol):
    """What the actor needs from an event loop family."""

    async def exchange(self, mailbox: Mailbox, message: Any, undo: Undo | None) -> Any:
        """Post ``message`` with a fresh slot and wait for its reply (always a checkpoint)."""

    def wake(self) -> None:
        """Wake the actor if it sleeps; cheap and idempotent."""

    async def sleep(self) -> None:
        """Park the actor until `wake` (cancellable)."""


class AsyncioBackend:
    """Loop futures as reply slots and as the actor's alarm clock (asyncio, uvloop)."""

    __slots__ = ("_loop", "_sleeper")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sleeper: asyncio.Future[None] | None = None

    async def exchange(self, mailbox: Mailbox, message: Any, undo: Undo | None) -> Any:
        slot = self._loop.create_future()
        mailbox.post(message, slot)
        try:
            return await slot
        except BaseException:
            # Cancelled while queued or being handled: task.cancel() already cancelled
            # the future, so the actor will see the slot abandoned. Cancelled after the
            # actor replied: the reply is in the future but this caller never reads it.
            if not slot.done():
                slot.cancel()
                mailbox.waiter_left()
            elif slot.cancelled():
                mailbox.waiter_left()
            elif undo is not None and slot.exception() is None:
                mailbox.give_back(message, slot.result(), undo)
            raise

    def wake(self) -> None:
        sleeper = self._sleeper
        if sleeper is not None:
            self._sleeper = None
            if not sleeper.done():
                sleeper.set_result(None)

    async def sleep(self) -> None:
        sleeper = self._loop.create_future()
        self._sleeper = sleeper
        try:
            await sleeper
        finally:
            self._sleeper = None


class _TrioSlot:
    """A parked trio task waiting for its reply; abandoned once trio aborts the wait."""

    __slots__ = ("_abandoned", "_task")

    def __init__(self, task: Any) -> None:
        self._task = task
        self._abandoned = False

    def cancelled(self) -> bool:
        return self._abandoned

    def set_result(self, result: Any, /) -> None:
        _trio.reschedule(self._task, _trio.Value(result))

    def set_exception(self, exception: BaseException, /) -> None:
        _trio.reschedule(self._task, _trio.Error(exception))

    def abort(self, _raise_cancel: Any) -> Any:
        # Trio only aborts a task that is still parked: the actor has not replied yet.
        self._abandoned = True
        return _trio.SUCCEEDED


class _TrioNames:
    """Trio's low-level names, bound on first use: trio is an optional dependency."""

    reschedule: Any = None
    Value: Any = None
    Error: Any = None
    SUCCEEDED: Any = None

    def bind(self) -> None:
        if self.reschedule is None:
            import outcome
            import trio

            self.reschedule = trio.lowlevel.reschedule
            self.Value = outcome.Value
            self.Error = outcome.Error
            self.SUCCEEDED = trio.lowlevel.Abort.SUCCEEDED


_trio = _TrioNames()


class TrioBackend:
    """Direct task rescheduling: a reply is delivered by waking the caller's task.

    A trio task the actor has rescheduled is no longer parked, so trio cannot abort its
    wait: the caller always reads a delivered reply and a cancellation lands at its next
    checkpoint. ``give_back`` is therefore never needed here.
    """

    __slots__ = ("_sleeper", "_trio")

    def __init__(self) -> None:
        import trio

        _trio.bind()
        self._trio = trio
        self._sleeper: Any = None

    async def exchange(self, mailbox: Mailbox, message: Any, undo: Undo | None) -> Any:
        lowlevel = self._trio.lowlevel
        slot = _TrioSlot(lowlevel.current_task())
        mailbox.post(message, slot)
        try:
            return await lowlevel.wait_task_rescheduled(slot.abort)
        except BaseException:
            if slot._abandoned:
                mailbox.waiter_left()
            raise

    def wake(self) -> None:
        sleeper = self._sleeper
        if sleeper is not None:
            self._sleeper = None
            self._trio.lowlevel.reschedule(sleeper)

    async def sleep(self) -> None:
        lowlevel = self._trio.lowlevel
        self._sleeper = lowlevel.current_task()

        def abort(_raise_cancel: Any) -> Any:
            self._sleeper = None
            return lowlevel.Abort.SUCCEEDED

        await lowlevel.wait_task_rescheduled(abort)


def current_backend() -> Backend:
    """The backend for the running event loop (asyncio, uvloop or trio)."""
    library = sniffio.current_async_library()
    if library == "trio":
        return TrioBackend()
    if library == "asyncio":
        return AsyncioBackend()
    raise RuntimeError(f"kvpool's actor runs on asyncio or trio, not {library!r}")
