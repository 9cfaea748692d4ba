"""Reply slots: how a caller waits for the actor's reply, per event loop.

A `ReplySlot` is the one object a call and the actor share. The caller awaits it; the
actor delivers into it (``set_result`` / ``set_exception``) unless ``cancelled()`` says
the caller stopped waiting. `SlotKind` bundles, per loop, the three things a call needs
besides the slot: a factory that also checks the call runs on the actor's own loop, a
cancel check, and ``abandon`` for a caller whose wait was interrupted.

- asyncio and uvloop: the slot *is* a loop future (the cheapest awaitable there). A
  future already done when the caller's cancellation lands holds a reply nobody will
  read; ``abandon`` hands it back so the actor can undo it.
- trio: the slot parks the calling task and the actor reschedules it with the reply.
  A rescheduled task can no longer be aborted, so a delivered reply is always read.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Final, Protocol

import anyio.lowlevel

from kvpool.errors import WrongLoopError


class ReplySlot(Protocol):
    """The actor's view of a pending call: exactly the shape of an asyncio future."""

    def cancelled(self) -> bool:
        """True once the caller stopped waiting; the reply must then not be delivered."""

    def set_result(self, result: Any, /) -> None:
        """Deliver the reply (only while not cancelled, at most once)."""

    def set_exception(self, exception: BaseException, /) -> None:
        """Deliver an error instead of a reply (only while not cancelled, at most once)."""

    def __await__(self) -> Generator[Any, None, Any]:
        """The caller waits here for the reply (or its error)."""


NO_REPLY: Final = object()
"""What `SlotKind.abandon` returns when no reply was left unread."""


@dataclass(frozen=True, slots=True)
class SlotKind:
    """The reply path of one event loop: make slots, check for cancellation, abandon.

    ``new()`` returns a fresh slot for the calling task, or raises `WrongLoopError` when
    the caller is not on the actor's loop. ``checkpoint_if_cancelled()`` raises the
    loop's cancellation if the calling task's scope is cancelled, else returns at once.
    ``abandon(slot)`` is called by a caller whose wait raised: it marks a pending slot
    abandoned and returns `NO_REPLY`, or returns the reply that arrived unread.
    """

    new: Callable[[], ReplySlot]
    checkpoint_if_cancelled: Callable[[], Awaitable[None]]
    abandon: Callable[[ReplySlot], Any]


def _wrong_loop(where: str) -> WrongLoopError:
    return WrongLoopError(
        f"this pool belongs to the event loop it was opened on, not {where}; from another "
        "thread, call it through anyio.from_thread.run(...) with that loop's portal or token"
    )


# ------------------------------------------------------------------ asyncio, uvloop


def _anyio_scope_check() -> Callable[[], bool] | None:
    """A direct read of anyio's cancel-scope state for the current asyncio task.

    ``anyio.lowlevel.checkpoint_if_cancelled`` costs 1.4-2 us on asyncio (a sniffio
    lookup and a WeakKeyDictionary lookup per call), more than a whole round trip to the
    actor; this reads the same state (the task's scope chain up to a shield) in about
    0.15 us. None if this anyio lays its state out differently: the public function is
    used then (tests/test_actor_cancellation.py checks the two agree).
    """
    try:
        from anyio._backends._asyncio import CancelScope, _task_states
    except ImportError:  # pragma: no cover - a future anyio
        return None
    states = getattr(_task_states, "data", None)
    if not isinstance(states, dict) or not all(
        hasattr(CancelScope(), name) for name in ("_cancel_called", "_shield", "_parent_scope")
    ):
        return None  # pragma: no cover - a future anyio
    current_task = asyncio.current_task
    ref = weakref.ref

    def scope_cancelled() -> bool:
        state = states.get(ref(current_task()))
        scope = None if state is None else state.cancel_scope
        while scope is not None:
            if scope._cancel_called:
                return True
            if scope._shield:
                return False
            scope = scope._parent_scope
        return False

    return scope_cancelled


_scope_cancelled = _anyio_scope_check()


async def _asyncio_checkpoint_if_cancelled() -> None:
    if _scope_cancelled is None:  # pragma: no cover - a future anyio
        await anyio.lowlevel.checkpoint_if_cancelled()
    elif _scope_cancelled():
        await anyio.lowlevel.checkpoint()  # anyio delivers the cancellation here


def _abandon_future(slot: Any) -> Any:
    if not slot.done():
        slot.cancel()  # the actor now sees the call abandoned
        return NO_REPLY
    if slot.cancelled() or slot.exception() is not None:
        return NO_REPLY
    return slot.result()


def asyncio_slots() -> SlotKind:
    """Loop futures of the running asyncio (or uvloop) loop."""
    loop = asyncio.get_running_loop()
    create_future = loop.create_future
    running_loop = asyncio._get_running_loop

    def new() -> ReplySlot:
        if running_loop() is not loop:
            raise _wrong_loop(f"thread {threading.current_thread().name!r}'s loop")
        slot: ReplySlot = create_future()
        return slot

    return SlotKind(new, _asyncio_checkpoint_if_cancelled, _abandon_future)


# ----------------------------------------------------------------------------- trio


class _TrioSlot:
    """A parked trio task waiting for its reply; abandoned once trio aborts the wait."""

    __slots__ = ("_abandoned", "_task")

    def __init__(self, task: Any) -> None:
        self._task = task
        self._abandoned = False

    def cancelled(self) -> bool:
        return self._abandoned

    def set_result(self, result: Any, /) -> None:
        _trio.reschedule(self._task, _outcome.Value(result))

    def set_exception(self, exception: BaseException, /) -> None:
        _trio.reschedule(self._task, _outcome.Error(exception))

    def _abort(self, _raise_cancel: Any) -> Any:
        # Trio aborts only a task that is still parked: the actor has not replied.
        self._abandoned = True
        return _trio.Abort.SUCCEEDED

    def __await__(self) -> Generator[Any, None, Any]:
        waiting: Generator[Any, None, Any] = _trio.wait_task_rescheduled(self._abort).__await__()
        return waiting


_trio: Any = None  # trio.lowlevel, bound on first use (trio is optional)
_outcome: Any = None


def _abandon_trio(slot: Any) -> Any:
    # An aborted wait marked the slot itself; a rescheduled task always reads its reply.
    return NO_REPLY


def trio_slots() -> SlotKind:
    """Parked tasks of the running trio run."""
    global _trio, _outcome
    import outcome
    import trio

    _trio, _outcome = trio.lowlevel, outcome
    token = trio.lowlevel.current_trio_token()
    current_token = trio.lowlevel.current_trio_token
    current_task = trio.lowlevel.current_task

    def new() -> ReplySlot:
        try:
            same = current_token() is token
        except RuntimeError:
            same = False
        if not same:
            raise _wrong_loop(f"thread {threading.current_thread().name!r}")
        return _TrioSlot(current_task())

    return SlotKind(new, trio.lowlevel.checkpoint_if_cancelled, _abandon_trio)
