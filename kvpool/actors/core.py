"""The generic actor: a mailbox, a handler table keyed by message type, a FIFO of waiters.

The actor owns some synchronous state through its handlers and runs them one message at
a time, so each handler call is one atomic turn. It knows nothing about block pools:
`kvpool.actors.pool_state` supplies the pool's handlers and later layers add their own.

Mailbox: a deque of ``(message, slot)`` pairs. Posting appends and wakes the actor, so it
never blocks and cannot be half-done; the actor drains the whole deque in one go before
sleeping again, so under load one wake-up serves many calls. While the actor sleeps on an
empty mailbox with nobody waiting, a caller takes the turn itself instead of posting (a
direct turn, `kvpool.actors.loops`): the same handler, run the same way, with no slot
and no wake-up (benchmarks/bench_actor.py measures both paths).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

import anyio.lowlevel

from kvpool.errors import (
    InvalidArgumentError,
    InvariantViolationError,
    PoolClosedError,
    PoolCrashedError,
    PoolError,
)

M = TypeVar("M")
R = TypeVar("R")


class Wait(enum.Enum):
    """The type of `WAIT` (for handler return annotations: ``Reply | Wait``)."""

    WAIT = "WAIT"


_Wait = Wait  # the name this type had first; kept for early users

WAIT: Final = Wait.WAIT
"""Returned by a handler to park its request in the FIFO of waiters (see `Handler`)."""


@dataclass(frozen=True, slots=True)
class Handler(Generic[M, R]):
    """How the actor runs one message kind.

    ``handle(message)`` runs in one actor turn and returns the reply. It must validate
    before it mutates: raising a `PoolError` (other than `InvariantViolationError`) refuses
    the request, reaches its caller, and must leave the state unchanged. Any other
    exception is a bug and crashes the actor.

    ``undo(message, reply)`` is set for calls that hand ownership to their caller. The
    actor runs it, in a later turn, when the caller never reads ``reply`` (cancelled
    after the actor replied); it must give that ownership back and must not fail. A call
    whose caller is gone before the actor reaches it is skipped instead.

    ``gives_back`` marks calls that return ownership (release, cancel, free): they run
    even if their caller stopped waiting, and after them the actor retries its waiters.

    ``waits(message)`` marks requests that may return `WAIT`. Such a request is tried at
    once only when nobody waits; otherwise it joins the FIFO behind the earlier waiters
    untried. Waiters are retried in order, head first, whenever a ``gives_back`` call or
    an undo ran or a waiter left, and the head blocks everyone behind it.
    """

    handle: Callable[[M], R | Wait]
    undo: Callable[[M, R], None] | None = None
    gives_back: bool = False
    waits: Callable[[M], bool] | None = None


class ReplySlot(Protocol):
    """The actor's view of a pending call: exactly the shape of an asyncio future."""

    def cancelled(self) -> bool:
        """True once the caller stopped waiting; the reply must then not be delivered."""

    def set_result(self, result: Any, /) -> None:
        """Deliver the reply (only while not cancelled, at most once)."""

    def set_exception(self, exception: BaseException, /) -> None:
        """Deliver an error instead of a reply (only while not cancelled, at most once)."""


class Status(enum.Enum):
    """The actor's life cycle: open, then closed (normal exit) or crashed (a bug)."""

    OPEN = "open"
    CLOSED = "closed"
    CRASHED = "crashed"


class _Undo:
    """An internal mailbox entry: give back what an unread reply handed out."""

    __slots__ = ("message", "reply", "undo")

    def __init__(self, message: Any, reply: Any, undo: Callable[[Any, Any], None]) -> None:
        self.message = message
        self.reply = reply
        self.undo = undo


_Entry = tuple[Any, ReplySlot | None]

YIELD_EVERY: Final = 32
"""Direct turns per checkpoint, by default: a cooperative budget, as tokio gives each
task. A direct turn passes a checkpoint (a schedule point and a cancel point) only when
it spends the actor's last unit of budget, so a task calling an idle pool in a loop
still lets others run and sees its cancellation within this many calls, without paying
a task switch on every call (the switch costs 2 to 8 times the turn itself). A call
that passes no checkpoint completes: it cannot be cancelled, on any loop. Posted calls
always wait for the actor, so they always yield. ``yield_every=1`` makes every call a
checkpoint, for code that wants trio's every-call rule or the most interleavings."""


class Actor:
    """Serializes calls to handlers; see the module docstring and `Handler`.

    This base holds the loop-independent part (the mailbox, dispatch, waiters, close and
    crash); `kvpool.actors.loops` adds ``call`` and the idle sleep for asyncio and trio.
    Single-threaded: every method must be called from the event loop the actor runs on.
    """

    __slots__ = (
        "_budget",
        "_cause",
        "_direct_turns",
        "_dirty",
        "_handlers",
        "_idle",
        "_on_crash",
        "_queue",
        "_status",
        "_waiters",
        "_yield_every",
    )

    def __init__(
        self, handlers: Mapping[type[Any], Handler[Any, Any]], *, yield_every: int = YIELD_EVERY
    ) -> None:
        if type(yield_every) is not int or yield_every < 1:
            raise InvalidArgumentError(f"yield_every must be an int >= 1, got {yield_every!r}")
        self._handlers: dict[type[Any], Handler[Any, Any]] = dict(handlers)
        self._queue: deque[_Entry] = deque()
        self._waiters: deque[tuple[Any, ReplySlot, Handler[Any, Any]]] = deque()
        self._dirty = False  # something changed that may let the head waiter in
        self._status = Status.OPEN
        self._cause: BaseException | None = None
        self._on_crash: Callable[[], None] | None = None
        self._direct_turns = True
        # True only while the actor sleeps on an empty mailbox with nobody waiting and
        # direct turns are on: a caller may then take the turn itself. Set when the
        # actor parks; cleared by anything that wakes it, queues a waiter or ends it.
        self._idle = False
        self._yield_every = yield_every
        self._budget = yield_every  # direct turns left before the next checkpoint

    # ------------------------------------------------------------------ callers

    @property
    def status(self) -> Status:
        """Open, closed or crashed."""
        return self._status

    @property
    def crash_cause(self) -> BaseException | None:
        """The exception that crashed the actor, if it crashed."""
        return self._cause

    @property
    def num_queued(self) -> int:
        """Requests posted and not yet handled."""
        return len(self._queue)

    @property
    def num_waiters(self) -> int:
        """Requests parked in the FIFO (including ones whose caller just left)."""
        return len(self._waiters)

    @property
    def direct_turns(self) -> bool:
        """Whether callers of an idle actor take its turn themselves (the default) or
        always post to the mailbox (for tests and benchmarks of the mailbox path)."""
        return self._direct_turns

    @direct_turns.setter
    def direct_turns(self, value: bool) -> None:
        self._direct_turns = value
        self._idle = self._idle and value

    @property
    def yield_every(self) -> int:
        """A direct turn yields to the event loop once every this many (see `YIELD_EVERY`)."""
        return self._yield_every

    def handles(self, kind: type[Any]) -> bool:
        """Whether messages of type ``kind`` have a handler."""
        return kind in self._handlers

    async def call(self, message: Any, unwrap: Callable[[Any], Any] | None = None) -> Any:
        """Send ``message`` and return its handler's reply.

        A posted call always yields; a direct turn passes a checkpoint once every
        ``yield_every`` turns (see `YIELD_EVERY`).

        With ``unwrap`` the caller gets ``unwrap(reply)`` instead (one coroutine less
        for a client method that only picks a field).

        Raises what the handler raised, `PoolClosedError` / `PoolCrashedError` once the actor is
        gone, or `InvalidArgumentError` for a message kind without a handler.
        Cancellation follows the handler's contract (skipped, undone, or run anyway).
        """
        raise NotImplementedError

    async def _refuse(self, message: Any) -> Any:
        """The slow path of ``call``: the actor is gone or the kind is unknown."""
        await anyio.lowlevel.checkpoint()
        if self._status is not Status.OPEN:
            raise self.gone_error()
        raise InvalidArgumentError(f"no handler for message {message!r}")

    def _turn_failed(self, exc: BaseException) -> BaseException:
        """A direct turn's handler raised ``exc``: return what its caller must raise.

        A refusal (a `PoolError` other than `InvariantViolationError`) is returned as is and
        changed nothing. Anything else is a bug: the actor crashes and the caller gets
        `PoolCrashedError`; an exception that is not an `Exception` (e.g. KeyboardInterrupt)
        propagates as it is, after the crash.
        """
        if isinstance(exc, PoolError) and not isinstance(exc, InvariantViolationError):
            return exc
        self._crash(exc, None)
        if not isinstance(exc, Exception):
            return exc
        return self.gone_error()

    def _wake(self) -> None:
        """Wake the actor if it sleeps (cheap, idempotent)."""
        raise NotImplementedError

    async def _sleep(self) -> None:
        """Park the actor until `_wake`."""
        raise NotImplementedError

    # -------------------------------------------------------------- the actor

    async def run(self) -> None:
        """The actor task: drain the mailbox, retry waiters, sleep; until closed."""
        queue = self._queue
        sleep = self._sleep
        while self._status is Status.OPEN:
            if queue:
                self._drain()
            elif self._dirty:
                self._pump()
            else:
                await sleep()

    def set_crash_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once if the actor crashes (``open_actor`` cancels its body)."""
        self._on_crash = callback

    def close(self) -> None:
        """Handle everything queued, then fail every waiter and later call with PoolClosedError.

        Synchronous: handlers never await, so the final drain needs no event loop turn
        and works even while the closing task is being cancelled.
        """
        if self._status is not Status.OPEN:
            return
        self._drain()
        if self._status is not Status.OPEN:
            return
        if self._dirty:
            self._pump()
        if self._status is not Status.OPEN:
            return
        self._status = Status.CLOSED
        self._idle = False
        waiters = self._waiters
        while waiters:
            _message, slot, _handler = waiters.popleft()
            if not slot.cancelled():
                slot.set_exception(
                    PoolClosedError("the pool actor shut down before this request fit")
                )
        self._wake()

    def _drain(self) -> None:
        queue = self._queue
        handlers = self._handlers
        waiters = self._waiters
        while queue:
            message, slot = queue.popleft()
            handler = handlers[type(message)]
            if slot is None or waiters or handler.gives_back or slot.cancelled():
                self._handle_with_care(message, slot, handler)
                if self._status is not Status.OPEN:
                    return
                continue
            # The common case: a live caller, nobody waiting, nothing given back.
            try:
                reply = handler.handle(message)
            except InvariantViolationError as exc:
                self._crash(exc, slot)
                return
            except PoolError as exc:
                slot.set_exception(exc)
                continue
            except BaseException as exc:
                self._crash(exc, slot)
                if not isinstance(exc, Exception):
                    raise
                return
            if reply is WAIT:
                waiters.append((message, slot, handler))
            else:
                slot.set_result(reply)
        if self._dirty and waiters:
            self._pump()

    def _handle_with_care(
        self, message: Any, slot: ReplySlot | None, handler: Handler[Any, Any]
    ) -> None:
        """One message off the fast path: an undo, a give-back, an abandoned call, or
        a call arriving while others wait."""
        waiters = self._waiters
        try:
            if slot is None:  # an undo, posted by a caller that never read its reply
                handler.handle(message)
                self._dirty = True
                if waiters:
                    self._pump()
                return
            if slot.cancelled():
                if handler.gives_back:
                    self._dirty = True
                    try:
                        handler.handle(message)
                    except InvariantViolationError:
                        raise
                    except PoolError:
                        pass  # a mistake nobody is left to hear about
                    if waiters:
                        self._pump()
                return
            if waiters and handler.waits is not None and handler.waits(message):
                waiters.append((message, slot, handler))
                return
            reply = handler.handle(message)
        except InvariantViolationError as exc:
            self._crash(exc, slot)
            return
        except PoolError as exc:
            if slot is None:
                self._crash(exc, None)
                return
            slot.set_exception(exc)
            return
        except BaseException as exc:
            self._crash(exc, slot)
            if not isinstance(exc, Exception):
                raise
            return
        if reply is WAIT:
            waiters.append((message, slot, handler))
        else:
            slot.set_result(reply)
        if handler.gives_back:
            self._dirty = True
        if self._dirty and waiters:
            # Capacity came back: the waiters get it before later requests do.
            self._pump()

    def _pump(self) -> None:
        """Grant waiters in FIFO order until the head one still does not fit."""
        self._dirty = False
        waiters = self._waiters
        while waiters:
            message, slot, handler = waiters[0]
            if slot.cancelled():
                waiters.popleft()
                continue
            try:
                reply = handler.handle(message)
            except InvariantViolationError as exc:
                self._crash(exc, None)
                return
            except PoolError as exc:
                waiters.popleft()
                slot.set_exception(exc)
                continue
            except BaseException as exc:
                self._crash(exc, None)
                if not isinstance(exc, Exception):
                    raise
                return
            if reply is WAIT:
                return
            waiters.popleft()
            slot.set_result(reply)

    # ------------------------------------------------------- failure paths

    def give_back(self, message: Any, reply: Any, undo: Callable[[Any, Any], None]) -> None:
        """A caller will never read ``reply``: undo it in a later turn (or now if closed)."""
        if self._status is Status.OPEN:
            self._queue.append((_Undo(message, reply, undo), None))
            self._wake()
        elif self._status is Status.CLOSED:
            # No actor turn will come; handlers are synchronous, so undo right here.
            try:
                undo(message, reply)
            except BaseException as exc:
                self._crash(exc, None)
                raise

    def waiter_left(self) -> None:
        """A caller stopped waiting before its reply: retry the FIFO if it is non-empty."""
        if self._waiters and self._status is Status.OPEN:
            self._dirty = True
            self._wake()

    def _crash(self, cause: BaseException, slot: ReplySlot | None) -> None:
        """Fail the current call, everything queued and every waiter with PoolCrashedError."""
        self._status = Status.CRASHED
        self._idle = False
        self._cause = cause
        slots: list[ReplySlot] = [] if slot is None else [slot]
        slots.extend(s for _m, s in self._queue if s is not None)
        slots.extend(s for _m, s, _h in self._waiters)
        self._queue.clear()
        self._waiters.clear()
        for pending in slots:
            if not pending.cancelled():
                pending.set_exception(self.gone_error())
        self._wake()
        if self._on_crash is not None:
            self._on_crash()

    def gone_error(self) -> PoolError:
        """The error for a call the actor can no longer serve (crashed or closed)."""
        if self._status is Status.CRASHED:
            error = PoolCrashedError(f"the pool actor crashed: {self._cause!r}")
            error.__cause__ = self._cause
            return error
        return PoolClosedError("the pool actor has shut down")


def _run_undo(entry: _Undo) -> None:
    entry.undo(entry.message, entry.reply)


UNDO_HANDLER: Final[Handler[_Undo, None]] = Handler(_run_undo, gives_back=True)
"""Runs an `_Undo` entry; every actor registers it."""
