"""kvpool's error types: every caller mistake is a `PoolError` that changes nothing.

The reference pool panics on a caller's mistake; kvpool raises one of the classes below
instead, after validating and before mutating, so the pool is exactly as it was. Two
classes are not caller mistakes: `InvariantViolation` (a bug inside the pool) and the
actor's `PoolClosed` / `PoolCrashed`.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base class of every error kvpool raises on purpose."""


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


class AlreadyCachedError(BlockError):
    """``cache_private`` of a copy that is already in the prefix cache."""


class InvariantViolation(PoolError):
    """The pool's internal state breaks one of its invariants: a bug, never a caller's."""


class PoolClosed(PoolError):
    """The pool actor has shut down; the call was not performed."""


class PoolCrashed(PoolError):
    """The pool actor died of an internal error; ``__cause__`` holds that error."""


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


class TraceError(PoolError, ValueError):
    """A workload trace is malformed; ``line`` names the 1-based line at fault (or None)."""

    def __init__(self, message: str, *, source: str, line: int | None = None) -> None:
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")
