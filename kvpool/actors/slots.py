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
  A rescheduled task can no longer be aborted, so a delivered reply is always read by
  the call (`interrupt_safe` code cannot be interrupted by Ctrl-C between the post and
  the park, nor between the reply and the caller's bookkeeping).
"""

from __future__ import annotations

import asyncio
import math
import threading
import types
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol, TypeVar

import anyio.lowlevel
import sniffio

from kvpool.errors import WrongLoopError


class ReplySlot(Protocol):
    """The actor's view of a pending call: exactly the shape of an asyncio future."""

    def cancelled(self) -> bool:
        """True once the caller stopped waiting; the reply must then not be delivered."""

    def done(self) -> bool:
        """True once a reply or an error was delivered, or the caller stopped waiting."""

    def set_result(self, result: Any, /) -> None:
        """Deliver the reply (only while not cancelled, at most once)."""

    def set_exception(self, exception: BaseException, /) -> None:
        """Deliver an error instead of a reply (only while not cancelled, at most once)."""

    def __await__(self) -> Generator[Any, None, Any]:
        """The caller waits here for the reply (or its error)."""


NO_REPLY: Final = object()
"""What `SlotKind.abandon` returns when no reply was left unread."""

_INTERRUPT_SAFE: list[Callable[..., Any]] = []
_trio_protect: Callable[[Callable[..., Any]], Any] | None = None

F = TypeVar("F", bound=Callable[..., Any])


def interrupt_safe(function: F) -> F:
    """Mark ``function`` as code trio's Ctrl-C must not land in (KI-protected).

    trio raises KeyboardInterrupt at any bytecode of unprotected code. The actor's loop
    and the caller's side of a call (post, park, abandon, the client's bookkeeping
    around the reply) are marked, so an interrupt is delivered to trio's main task at
    its next wait instead, where the call's abandon path handles it. The mark is a
    per-code-object flag: no cost on any loop, and no trio import until trio runs.
    """
    _INTERRUPT_SAFE.append(function)
    if _trio_protect is not None:
        _trio_protect(function)
    return function


def _protect_all() -> None:
    global _trio_protect
    if _trio_protect is None:
        import trio

        _trio_protect = trio.lowlevel.enable_ki_protection
        for function in _INTERRUPT_SAFE:
            _trio_protect(function)


@dataclass(frozen=True, slots=True)
class SlotKind:
    """The reply path of one event loop: open slots, and abandon them.

    ``open(cancel_point)`` returns a fresh slot for the calling task, or None when
    ``cancel_point`` is set and the task's scope is cancelled (a checkpoint then raises
    the cancellation); it raises `WrongLoopError` when the caller is not on the actor's
    loop. Both checks run on every call, so they are one plain function. ``abandon``
    is called by a caller whose wait raised: it marks a pending slot abandoned and
    returns `NO_REPLY`, or returns the reply that arrived unread. ``yield_once`` lets
    the actor give every ready caller a turn before it looks at its mailbox again.
    """

    open: Callable[[bool], ReplySlot | None]
    abandon: Callable[[ReplySlot], Any]
    yield_once: Callable[[], Awaitable[Any]]
    """A schedule point for the (shielded) actor task: the loop's own, without anyio's
    backend lookup, which costs more than a whole round trip's other work."""


def _wrong_loop(where: str) -> WrongLoopError:
    return WrongLoopError(
        f"this pool belongs to the event loop it was opened on, not {where}; from another "
        "thread, call it through anyio.from_thread.run(...) with that loop's portal or token"
    )


# ------------------------------------------------------------------ asyncio, uvloop


def _anyio_task_states() -> Any:
    """anyio's per-task state on asyncio (the task's innermost cancel scope), or None
    if this anyio lays it out differently (anyio's public API answers then)."""
    try:
        from anyio._backends._asyncio import CancelScope, _task_states

        probe = CancelScope()
        (probe._cancel_called, probe._shield, probe._parent_scope)  # noqa: B018
    except (ImportError, AttributeError):  # pragma: no cover - a future anyio
        return None
    return _task_states


def _abandon_future(slot: Any) -> Any:
    if not slot.done():
        slot.cancel()  # the actor now sees the call abandoned
        return NO_REPLY
    if slot.cancelled() or slot.exception() is not None:
        return NO_REPLY
    return slot.result()


@types.coroutine
def _next_turn() -> Generator[None, None, None]:
    """The actor's schedule point on asyncio: a bare yield, which a task answers by
    running again on the loop's next turn (what ``asyncio.sleep(0)`` does, without its
    coroutine and the partial around it: the actor takes one per round trip)."""
    yield


def asyncio_slots() -> SlotKind:
    """Futures of the running asyncio (or uvloop) loop.

    The cancel check reads anyio's cancel scopes directly: anyio's own
    ``checkpoint_if_cancelled`` costs 1.4-2 us on asyncio (a sniffio lookup and a
    WeakKeyDictionary lookup per call), more than a whole round trip to the actor. Each
    task's anyio state is kept in a plain dict until the task is done; the walk up its
    scopes stops at a shield, as anyio's does (tests/actors/test_actor_cancellation.py checks
    the two agree, and anyio's ``current_effective_deadline`` is the fallback). Measured
    with benchmarks/bench_actor.py's round trip at 100 clients: 1.6 us a call on uvloop
    and 2.1 on asyncio, against 3.3 and 3.8 with the public answer (trio: 3.5 against
    4.6); pyproject pins the anyio and trio versions it was checked against.
    """
    loop = asyncio.get_running_loop()
    new_future = partial(asyncio.Future, loop=loop)
    owner = threading.get_ident()
    get_ident = threading.get_ident
    # The running task of ``loop`` in one C call (asyncio.current_task is Python in
    # 3.11, and asyncio._get_running_loop costs 0.3-0.5 us here): None unless ``loop``
    # is running a task, which on the owner thread means the caller is that task.
    tasks = getattr(asyncio.tasks, "_current_tasks", None)
    task_of: Callable[[], Any] = (
        partial(tasks.get, loop) if isinstance(tasks, dict) else partial(asyncio.current_task, loop)
    )
    task_states = _anyio_task_states()
    known: dict[Any, Any] = {}  # task -> its anyio TaskState, which lives as long as it

    def open_slot(cancel_point: bool) -> ReplySlot | None:
        task = task_of()
        if task is None or get_ident() != owner:
            raise _wrong_loop(f"thread {threading.current_thread().name!r}'s loop")
        if cancel_point:
            state = known.get(task)
            if state is None:
                if task_states is None:  # pragma: no cover - a future anyio
                    if anyio.current_effective_deadline() == -math.inf:
                        return None
                else:
                    state = task_states.get(task)
                    if state is not None:
                        known[task] = state
                        task.add_done_callback(known.pop)
            scope = None if state is None else state.cancel_scope
            while scope is not None and not scope._cancel_called:
                scope = None if scope._shield else scope._parent_scope
            if scope is not None:
                return None
        slot: ReplySlot = new_future()
        return slot

    return SlotKind(open_slot, _abandon_future, _next_turn)


# ----------------------------------------------------------------------------- trio


_PENDING: Final = 0  # posted, the caller not parked yet
_PARKED: Final = 1  # the caller waits in trio's scheduler
_DELIVERED: Final = 2
_FAILED: Final = 3
_ABANDONED: Final = 4


class _TrioSlot:
    """A trio task waiting for its reply; abandoned once trio aborts the wait, or once
    the call is interrupted before it read its reply.

    The actor reschedules the task only while it is parked here: a reply that arrives
    before the caller parked (its call yielded elsewhere first, e.g. at the checkpoint
    of a give-back in a cancelled scope) is kept and returned when the caller awaits.
    """

    __slots__ = ("_error", "_reply", "_state", "_task")

    def __init__(self, task: Any) -> None:
        self._task = task
        self._state = _PENDING
        self._reply: Any = NO_REPLY
        self._error: BaseException | None = None

    def cancelled(self) -> bool:
        return self._state == _ABANDONED

    def done(self) -> bool:
        return self._state >= _DELIVERED

    def set_result(self, result: Any, /) -> None:
        parked = self._state == _PARKED
        self._state = _DELIVERED
        self._reply = result
        if parked:
            _trio.reschedule(self._task, _outcome.Value(result))

    def set_exception(self, exception: BaseException, /) -> None:
        parked = self._state == _PARKED
        self._state = _FAILED
        if parked:
            _trio.reschedule(self._task, _outcome.Error(exception))
        else:
            self._error = exception

    def _abort(self, _raise_cancel: Any) -> Any:
        # Trio aborts only a task that is still parked: the actor has not replied.
        self._state = _ABANDONED
        return _trio.Abort.SUCCEEDED

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _PENDING:  # the common case: park until the actor replies
            self._state = _PARKED
            waiting: Generator[Any, None, Any] = _trio.wait_task_rescheduled(
                self._abort
            ).__await__()
            return waiting
        return self._early().__await__()

    async def _early(self) -> Any:
        """The reply (or error) that arrived before the caller parked."""
        if self._state == _DELIVERED:
            return self._reply
        error = self._error
        assert error is not None, "a trio reply slot awaited twice"
        self._error = None
        raise error


_trio: Any = None  # trio.lowlevel, bound on first use (trio is optional)
_outcome: Any = None


def _abandon_trio(slot: Any) -> Any:
    # An aborted wait marked the slot itself. A call interrupted before it parked (or
    # after its reply arrived, before it returned) marks it here: the actor must then
    # neither reschedule the task nor leave a delivered reply unreturned.
    if slot._state == _DELIVERED:
        slot._state = _ABANDONED
        reply = slot._reply
        slot._reply = NO_REPLY
        return reply
    if slot._state < _DELIVERED:
        slot._state = _ABANDONED
    return NO_REPLY


def trio_slots() -> SlotKind:
    """Parked tasks of the running trio run."""
    global _trio, _outcome
    import outcome
    import trio

    _trio, _outcome = trio.lowlevel, outcome
    _protect_all()
    token = trio.lowlevel.current_trio_token()
    current_token = trio.lowlevel.current_trio_token
    current_task = trio.lowlevel.current_task
    current_deadline = trio.current_effective_deadline

    def open_slot(cancel_point: bool) -> ReplySlot | None:
        try:
            same = current_token() is token
        except RuntimeError:
            same = False
        if not same:
            raise _wrong_loop(f"thread {threading.current_thread().name!r}")
        task = current_task()
        if cancel_point:
            # What trio's own checkpoint_if_cancelled reads; the public deadline query
            # costs 1.8 us here, a third of a whole round trip.
            status = getattr(task, "_cancel_status", None)
            if (
                status.effectively_cancelled
                if status is not None
                else current_deadline() == -math.inf
            ):
                return None
        return _TrioSlot(task)

    return SlotKind(open_slot, _abandon_trio, trio.lowlevel.cancel_shielded_checkpoint)


def current_slots() -> SlotKind:
    """The reply path of the running event loop (asyncio, uvloop or trio)."""
    library = sniffio.current_async_library()
    if library == "trio":
        return trio_slots()
    if library == "asyncio":
        return asyncio_slots()
    raise RuntimeError(f"kvpool's actor runs on asyncio or trio, not {library!r}")
