"""The actor: one task, one anyio mailbox, a handler table, a FIFO of waiters.

One path leads from a call to its handler and back. `Actor.call` (in the caller's task)
checks for cancellation, posts ``(message, handler, slot)`` to the mailbox, an unbounded
anyio memory object stream, with ``send_nowait`` (never blocks, cannot be half done),
and awaits the slot. `Actor.run` (the actor's task, the only code that runs handlers)
drains the mailbox in batches and delivers each reply into its slot. The contract this
implements is stated once, in `kvpool.actors`; the reply slots are `kvpool.actors.slots`.

Invariants the loop keeps: nothing raised in the actor task escapes `Actor.run` (a bug
or an interrupt there is a crash, answered to every waiter); an unread reply's undo is
queued on the actor itself (`Actor._undos`) and runs before the actor hands out
anything of the same ordered stream again; the mailbox's streams are closed once the
actor is done (`Actor.dispose`), so a late post (an undo's wake-up) is dropped.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from kvpool.actors.slots import NO_REPLY, ReplySlot, SlotKind, interrupt_safe
from kvpool.errors import (
    ActorClosedError,
    ActorCrashedError,
    InvalidArgumentError,
    PoolClosedError,
    PoolCrashedError,
    PoolError,
)

M = TypeVar("M")
R = TypeVar("R")


class Wait(enum.Enum):
    """The type of `WAIT` (for handler return annotations: ``Reply | Wait``)."""

    WAIT = "WAIT"


WAIT: Final = Wait.WAIT
"""Returned by a handler to park its request in the FIFO of waiters (see `Handler`)."""


@dataclass(frozen=True, slots=True)
class Handler(Generic[M, R]):
    """How the actor runs one message kind.

    ``handle(message)`` runs in one actor turn and returns the reply; raising a
    `PoolError` refuses the request (it must then have changed nothing), raising
    anything else crashes the actor (the refuse-or-crash rule, `kvpool.errors`).

    ``undo(message, reply)`` gives back what a reply handed out, in a later turn, when
    its caller never read it; it must not fail (if it raises, the actor crashes).
    ``gives_back`` marks calls returning ownership (release, cancel, free): they run
    even if their caller left, and the waiters are retried after them. ``waits(message)``
    marks requests whose handler may return `WAIT`: such a request joins the FIFO behind
    earlier waiters untried, and the head waiter is retried whenever something was given
    back. ``ordered`` marks calls whose replies hand out consecutive pieces of one
    stream (the manager's events): before the actor serves another ordered call, every
    caller of an earlier one has read its reply or had it undone, so an undo that puts a
    piece back never lands behind a newer piece someone else already took.
    """

    handle: Callable[[M], R | Wait]
    undo: Callable[[M, R], None] | None = None
    gives_back: bool = False
    waits: Callable[[M], bool] | None = None
    ordered: bool = False


@dataclass(frozen=True, slots=True)
class ActorIdentity:
    """Which actor this is, for the errors its callers get once it is gone: its name in
    their messages and the classes it raises (subclasses of `ActorClosedError` and
    `ActorCrashedError`, so a caller can catch either actor's, or any actor's)."""

    name: str
    closed: type[ActorClosedError]
    crashed: type[ActorCrashedError]


ANY_ACTOR: Final = ActorIdentity("actor", ActorClosedError, ActorCrashedError)
"""An actor over handlers of the caller's own (`open_actor`'s default)."""

POOL_ACTOR: Final = ActorIdentity("pool actor", PoolClosedError, PoolCrashedError)
"""The actor `open_pool` runs."""


class Status(enum.Enum):
    """The actor's life cycle: open, closing (leaving its block), closed, or crashed."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    CRASHED = "crashed"


class _Undo:
    """Give back what an unread reply handed out (queued on the actor, run in its task)."""

    __slots__ = ("message", "reply", "undo")

    def __init__(self, message: Any, reply: Any, undo: Callable[[Any, Any], None]) -> None:
        self.message = message
        self.reply = reply
        self.undo = undo


_OPEN: Final = Status.OPEN
_CRASHED: Final = Status.CRASHED
_Entry = tuple[Any, Handler[Any, Any], ReplySlot | None]
"""(message, its handler, the caller's slot; None for the actor's own entries)."""


class Actor:
    """Serializes calls to synchronous handlers over state only it touches.

    Built by `open_actor` / `open_pool` on the running loop; every method but `run` is
    for callers on that same loop (anything else raises `WrongLoopError`).
    """

    __slots__ = (
        "_abandon",
        "_cause",
        "_dirty",
        "_handlers",
        "_identity",
        "_on_crash",
        "_open_slot",
        "_ordered_out",
        "_post",
        "_receive",
        "_send",
        "_status",
        "_task_id",
        "_undo_entry",
        "_undos",
        "_waiters",
        "_yield_once",
    )

    def __init__(
        self,
        handlers: Mapping[type[Any], Handler[Any, Any]],
        slots: SlotKind,
        identity: ActorIdentity = ANY_ACTOR,
    ) -> None:
        if _Undo in handlers:
            raise InvalidArgumentError("the actor's own entry type cannot be registered")
        self._handlers: dict[type[Any], Handler[Any, Any]] = dict(handlers)
        self._identity = identity
        self._send, self._receive = anyio.create_memory_object_stream[_Entry](math.inf)
        self._post = self._send.send_nowait
        self._open_slot = slots.open
        self._abandon = slots.abandon
        self._yield_once = slots.yield_once
        self._waiters: deque[tuple[Any, Handler[Any, Any], ReplySlot]] = deque()
        self._dirty = False  # something was given back that may let the head waiter in
        self._undos: deque[_Undo] = deque()  # unread replies to give back, oldest first
        # Posted to wake the actor for queued undos; a give-back, so waiters are retried.
        self._undo_entry: _Entry = (None, Handler(self._run_undos, gives_back=True), None)
        self._ordered_out = False  # an ordered reply went out since the actor last yielded
        self._status = _OPEN
        self._cause: BaseException | None = None
        self._on_crash: Callable[[], None] | None = None
        self._task_id: int | None = None

    # ------------------------------------------------------------------ callers

    @property
    def status(self) -> Status:
        """Open, closing, closed or crashed."""
        return self._status

    @property
    def crash_cause(self) -> BaseException | None:
        """The exception that crashed the actor, if it crashed."""
        return self._cause

    @property
    def num_waiters(self) -> int:
        """Requests parked in the FIFO (including ones whose caller just left)."""
        return len(self._waiters)

    @property
    def task_id(self) -> int | None:
        """The anyio task id of the actor's task, once it runs (for tests and tracing)."""
        return self._task_id

    def handles(self, kind: type[Any]) -> bool:
        """Whether messages of type ``kind`` have a handler."""
        return kind in self._handlers

    @interrupt_safe
    async def call(self, message: Any) -> Any:
        """Send ``message`` and return its handler's reply; always a checkpoint.

        Raises what the handler raised, the actor's `ActorClosedError` /
        `ActorCrashedError` once it is gone (`gone_error`), `InvalidArgumentError` for a
        kind without a handler, and `WrongLoopError` off the actor's loop. Cancellation:
        `kvpool.actors`.
        """
        handler = self._handlers.get(type(message))  # the table is empty once it is gone
        if handler is None:
            return await self._refuse(message)
        slot = self._open_slot(True)
        if slot is None:  # the caller's scope is cancelled
            if handler.gives_back:
                return await self._give_back_cancelled(message, handler)
            # A call that hands something out takes no effect in a cancelled scope.
            await anyio.lowlevel.checkpoint()  # raises the scope's cancellation
            if not self._handlers:
                return await self._refuse(message)
            slot = self._open_slot(False)
            assert slot is not None
        try:
            self._post((message, handler, slot))
            return await slot
        except BaseException:
            self._left(message, handler, slot)
            raise

    @interrupt_safe
    async def _give_back_cancelled(self, message: Any, handler: Handler[Any, Any]) -> Any:
        """A give-back made in a cancelled scope: posted, so it takes effect, then the
        checkpoint every call is raises the scope's cancellation, on every loop (the
        reply, if it came meanwhile, is given back as any unread one)."""
        slot = self._open_slot(False)
        assert slot is not None
        try:
            self._post((message, handler, slot))
            await anyio.lowlevel.checkpoint()  # raises the scope's cancellation
            return await slot
        except BaseException:
            self._left(message, handler, slot)
            raise

    @interrupt_safe
    async def _refuse(self, message: Any) -> Any:
        """A call the actor will not take: gone, or a kind without a handler."""
        self._open_slot(False)  # WrongLoopError before anything else
        await anyio.lowlevel.checkpoint()  # a refused call yields too
        if self._status is not _OPEN:
            raise self.gone_error()
        raise InvalidArgumentError(f"no handler for message {message!r}")

    def _left(self, message: Any, handler: Handler[Any, Any], slot: ReplySlot) -> None:
        """The caller stopped waiting: give back a reply it will never read, or let the
        FIFO move on if it was waiting there."""
        reply = self._abandon(slot)
        if self._status is _CRASHED:
            return
        if reply is not NO_REPLY:
            if handler.undo is not None:
                self._undos.append(_Undo(message, reply, handler.undo))
                self._wake()
        elif handler.waits is not None:
            self._wake()

    def _wake(self) -> None:
        """Make the actor run its queued undos and retry its waiters."""
        # If the actor is gone, its state went with it: nothing is left to give back to.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._post(self._undo_entry)

    # ------------------------------------------------------------------ the host

    def set_crash_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once if the actor crashes (the host cancels its body)."""
        self._on_crash = callback

    def close(self) -> None:
        """Refuse new calls; the actor handles what is queued, fails the waiters with
        its `ActorClosedError`, then stops once every reply it delivered was taken or given
        back (`run`)."""
        if self._status is _OPEN:
            self._status = Status.CLOSING
            self._handlers = {}
            self._post((None, Handler(self._finish, gives_back=True), None))

    def dispose(self) -> None:
        """Close the mailbox's two streams (`run` does when it returns; the host does
        too, in case it never ran). Idempotent."""
        self._send.close()
        self._receive.close()

    def gone_error(self) -> ActorClosedError | ActorCrashedError:
        """The error for a call the actor can no longer serve (crashed or closed), of its
        identity's class and naming it."""
        identity = self._identity
        if self._status is Status.CRASHED:
            error = identity.crashed(f"the {identity.name} crashed: {self._cause!r}")
            error.__cause__ = self._cause
            return error
        return identity.closed(f"the {identity.name} has shut down")

    # ----------------------------------------------------------- the actor task

    @interrupt_safe
    async def run(self) -> None:
        """The actor task: drain the mailbox in batches until closed or crashed.

        Never raises: anything raised here (a handler's bug, a failing undo, an
        interrupt) crashes the actor, which answers every pending call first.
        """
        self._task_id = anyio.get_current_task().id
        receive = self._receive
        receive_nowait = receive.receive_nowait
        buffer = _buffer_of(receive)
        yield_once = self._yield_once
        waiters = self._waiters
        settled = yielded = False
        slot: ReplySlot | None = None
        try:
            while True:
                # ``slot`` is the current call's, or an answered one's (`_crash` skips it).
                entry: _Entry | None
                if buffer is not None and not buffer and not receive._closed:
                    entry = None  # empty and open: what WouldBlock says, not raised
                else:
                    try:
                        entry = receive_nowait()
                    except anyio.WouldBlock:
                        entry = None
                if entry is None:
                    if self._dirty and waiters:
                        self._pump()
                    status = self._status
                    if status is _CRASHED or settled:
                        return
                    if status is Status.CLOSED:
                        # Every caller answered so far is ready to run: let them, so that
                        # one cancelled with its reply unread queues the undo (asyncio; on
                        # trio a delivered reply is always read). Then nothing more can
                        # arrive but those undos' wake-ups.
                        await yield_once()
                        self._ordered_out = False
                        settled = True
                        continue
                    if not yielded:
                        # The callers just answered usually call again at once: one yield
                        # lets them post, and the next batch needs no wake-up.
                        await yield_once()
                        self._ordered_out = False
                        yielded = True
                        continue
                    entry = await receive.receive()
                message, handler, slot = entry
                yielded = False
                if handler.ordered:
                    if self._ordered_out:
                        # Let the earlier ordered replies' callers run: one that left
                        # unread queues its undo, which puts its piece back first.
                        await yield_once()
                        if self._undos:
                            self._run_undos(None)
                    self._ordered_out = True
                if slot is None or waiters or slot.cancelled():
                    self._handle_with_care(message, handler, slot)
                    continue
                # The common case: a live caller and nobody waiting.
                try:
                    reply = handler.handle(message)
                except PoolError as exc:
                    _fail(slot, exc)
                    continue
                if reply is WAIT:
                    waiters.append((message, handler, slot))
                    continue
                try:
                    slot.set_result(reply)
                except Exception:
                    self._undelivered(message, handler, slot, reply)
        except BaseException as exc:
            # A bug (or an interrupt) in a handler, an undo or the loop itself.
            if self._status is not _CRASHED:
                self._crash(exc, slot)
        finally:
            self.dispose()  # nothing is served any more: later posts are refused

    def _handle_with_care(
        self, message: Any, handler: Handler[Any, Any], slot: ReplySlot | None
    ) -> None:
        """The actor's own entry, a call whose caller left, or one arriving while others
        wait. Anything but a refusal propagates: `run` turns it into a crash."""
        waiters = self._waiters
        if slot is None or slot.cancelled():
            if not handler.gives_back:
                return  # the caller left before its turn: skipped
            self._dirty = True
            try:
                reply = handler.handle(message)
            except PoolError:
                if slot is None:
                    raise  # the actor's own entry must not be refused: that is a bug
                # A give-back whose caller left: a mistake nobody is left to hear.
            else:
                if slot is not None and handler.undo is not None:
                    handler.undo(message, reply)  # applied; nobody reads the reply
        elif waiters and handler.waits is not None and handler.waits(message):
            waiters.append((message, handler, slot))
            return
        else:
            try:
                reply = handler.handle(message)
            except PoolError as exc:
                _fail(slot, exc)
                return
            if handler.gives_back:
                self._dirty = True
            if reply is WAIT:
                waiters.append((message, handler, slot))
            else:
                self._deliver(message, handler, slot, reply)
        if self._dirty and waiters:
            self._pump()  # what came back goes to the waiters before later requests

    def _run_undos(self, _message: object) -> None:
        """Give back every queued unread reply, oldest first (a failing undo crashes)."""
        undos = self._undos
        while undos:
            entry = undos.popleft()
            entry.undo(entry.message, entry.reply)
        self._dirty = True

    def _pump(self) -> None:
        """Grant waiters in FIFO order until the head one still does not fit."""
        self._dirty = False
        waiters = self._waiters
        while waiters:
            message, handler, slot = waiters[0]
            if slot.cancelled():
                waiters.popleft()
                continue
            try:
                reply = handler.handle(message)
            except PoolError as exc:
                waiters.popleft()
                _fail(slot, exc)
                continue
            if reply is WAIT:
                return
            waiters.popleft()
            self._deliver(message, handler, slot, reply)

    def _deliver(
        self, message: Any, handler: Handler[Any, Any], slot: ReplySlot, reply: Any
    ) -> None:
        try:
            slot.set_result(reply)
        except Exception:
            self._undelivered(message, handler, slot, reply)

    def _undelivered(
        self, message: Any, handler: Handler[Any, Any], slot: ReplySlot, reply: Any
    ) -> None:
        """``set_result`` failed: if the caller left during the turn (a signal handler
        can cancel a task's future between any two bytecodes, e.g. asyncio's on Ctrl-C),
        nobody will read the reply, so it is given back now; anything else is a bug."""
        if not slot.cancelled():
            raise
        if handler.undo is not None:
            handler.undo(message, reply)

    def _finish(self, _message: object = None) -> None:
        """Everything posted before the close was handled: fail the waiters."""
        if self._dirty and self._waiters:
            self._pump()
        self._status = Status.CLOSED
        waiters = self._waiters
        while waiters:
            _message, _handler, slot = waiters.popleft()
            if not slot.cancelled():
                identity = self._identity
                _fail(slot, identity.closed(f"the {identity.name} shut down before this fit"))

    def _crash(self, cause: BaseException, slot: ReplySlot | None) -> None:
        """A bug (or an interrupt) in the actor task: fail the current call, every
        queued call and every waiter with its `ActorCrashedError`, and tell the host."""
        self._status = Status.CRASHED
        self._handlers = {}
        self._cause = cause
        self._undos.clear()
        slots: list[ReplySlot] = [] if slot is None else [slot]
        slots.extend(waiting for _m, _h, waiting in self._waiters)
        self._waiters.clear()
        while True:
            try:
                _message, _handler, queued = self._receive.receive_nowait()
            except anyio.WouldBlock:
                break
            if queued is not None:
                slots.append(queued)
        for pending in slots:
            if not pending.done():
                with contextlib.suppress(Exception):
                    pending.set_exception(self.gone_error())
        if self._on_crash is not None:
            self._on_crash()


def _buffer_of(receive: MemoryObjectReceiveStream[Any]) -> deque[Any] | None:
    """The mailbox's buffer, so `Actor.run` tells an empty mailbox without a raise:
    anyio's ``receive_nowait`` raises WouldBlock then, once per call from a lone caller
    (benchmarks/bench_actor.py's round trip at one client: 2.8 us on uvloop, against 3.0
    with the raise). None if this anyio lays its stream out differently
    (``receive_nowait`` answers then). An open mailbox with an empty buffer would block:
    it is unbounded, so no sender ever waits, and its send side closes only with its
    receive side (`Actor.dispose`)."""
    buffer = getattr(getattr(receive, "_state", None), "buffer", None)
    if type(buffer) is not deque or type(getattr(receive, "_closed", None)) is not bool:
        return None  # pragma: no cover - a future anyio
    return buffer


def _fail(slot: ReplySlot, error: BaseException) -> None:
    """Deliver ``error``, unless the caller left meanwhile (see `Actor._undelivered`)."""
    try:
        slot.set_exception(error)
    except Exception:
        if not slot.cancelled():
            raise
