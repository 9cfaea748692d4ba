"""kvpool's error types, and the one rule that sorts them: refuse or crash.

Every error kvpool raises on purpose is a `KvpoolError`. Of those, a `PoolError` means
*refused, nothing changed*: the reference pool panics on a caller's mistake, kvpool
validates before it mutates and raises a `PoolError` subclass instead, so the state
(pool, manager, actor) is exactly as it was. Anything else raised inside an actor's
handler is a bug and crashes the actor (`kvpool.actors`): `InvariantViolationError`
(the state broke one of its named invariants) or any non-kvpool exception. The
remaining classes report something other than a refused call: `ActorCrashedError` (an
actor died of such a bug) and `TraceError` (a malformed workload file).
"""

from __future__ import annotations


class KvpoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


class PoolError(KvpoolError):
    """A refused call: the caller's mistake (or a closed pool), and nothing changed."""


class InvalidArgumentError(PoolError, ValueError):
    """An argument has the wrong type or is out of range (a hash, a count, a capacity)."""


class InvalidHashError(InvalidArgumentError):
    """A block hash is not an ``int`` in ``[0, 2**64)``."""


class PrefixNotResidentError(PoolError, KeyError):
    """A hash passed as a reserved prefix has no resident cached copy."""

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0]) if self.args else ""


class ReservationError(PoolError):
    """A reservation cannot be used for the requested operation."""


class ReservationClosedError(ReservationError):
    """The reservation was already cancelled; any further use is a mistake."""


class ReservationExhaustedError(ReservationError):
    """An allocation asked for more fresh blocks than the reservation holds."""


class ForeignReservationError(ReservationError):
    """The object is not a reservation of this pool."""


class BlockError(PoolError):
    """A block id cannot be used for the requested operation."""


class UnknownBlockError(BlockError, KeyError):
    """The block id names no live copy of this pool (released, evicted, or foreign)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BlockNotReferencedError(BlockError):
    """A release of a cached copy that holds no request reference."""


class BlockSharedError(BlockError):
    """``unallocate`` of a copy held by more than the reference its allocation gave."""


class AlreadyCachedError(BlockError):
    """``cache_private`` of a copy that is already in the prefix cache."""


class InvariantViolationError(KvpoolError):
    """The internal state breaks one of its named invariants: a bug, never a caller's.

    Not a `PoolError`: raised inside an actor's handler, it crashes the actor.
    """


class ActorClosedError(PoolError):
    """An actor has shut down; the call was not performed. Its message names the actor
    (the pool's, the manager's); each actor raises its own subclass."""


class ActorCrashedError(KvpoolError):
    """An actor died of a bug in a handler; ``__cause__`` holds that error. Its message
    names the actor; each actor raises its own subclass."""


class PoolClosedError(ActorClosedError):
    """The pool actor (`kvpool.actors.open_pool`) has shut down."""


class PoolCrashedError(ActorCrashedError):
    """The pool actor died of a bug in a handler."""


class ManagerClosedError(ActorClosedError):
    """The manager actor (`kvpool.manager.open_manager`) has shut down."""


class ManagerCrashedError(ActorCrashedError):
    """The manager actor died of a bug in a handler."""


class CannotWaitError(PoolError):
    """A waiting call (``allocate(wait=True)``) did not fit on an inline client: no
    other task can give blocks back while the caller's own task runs the call, so it
    is refused (nothing changed) instead of waiting forever. Wait through an actor."""


class WrongLoopError(PoolError, RuntimeError):
    """A client was used from a thread or event loop other than its actor's.

    From another thread, reach the actor's loop with ``anyio.from_thread.run``.
    """


class CapacityError(PoolError):
    """A request can never fit: it needs more blocks than the whole pool holds."""


class RequestError(PoolError):
    """A request-level (manager) call names a request or a token count it cannot use."""


class UnknownRequestError(RequestError, KeyError):
    """The request id is not registered (never added, or already freed: a double free)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(RequestError):
    """``add_request`` of a request id that is already registered."""


class TokenCountError(RequestError, InvalidArgumentError):
    """A token count is out of range for the request (beyond its tokens or its blocks,
    or a computed count going backwards)."""


class TraceError(KvpoolError, ValueError):
    """A workload trace is malformed; ``line`` names the 1-based line at fault (or None)."""

    def __init__(self, message: str, *, source: str, line: int | None = None) -> None:
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
