"""`Operation`: one message kind of a service, declared once, as data.

A service (the pool's, the manager's) is its state, its message Structs and one
`Operation` per request kind naming everything about that kind: its request and reply
Structs, the state's method that handles it, the one that undoes an unread reply, and
the flags the actor reads (gives back, waits, ordered; their meaning is `Handler`'s).
`handler_table` binds the declarations to one state object, giving the table the actor
runs (`kvpool.actors.actor.Actor`) and the inline transport calls
(`kvpool.manager.client.InlineTransport`); tests/messages/test_protocols.py checks each
service's declarations against its message unions.

Every service follows one layout: its Structs in a ``messages`` module (the pool's in
`kvpool.messages`, layer 2, so a peer decodes them without loading an actor; the
manager's in `kvpool.manager.messages`), its state and ``OPERATIONS`` in an
``operations`` module (`kvpool.actors.pool_operations`, `kvpool.manager.operations`),
and its client in a ``client`` module (`kvpool.actors.client`, `kvpool.manager.client`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvpool.actors.actor import Handler, Wait
from kvpool.errors import InvalidArgumentError

S = TypeVar("S")
M = TypeVar("M")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Operation(Generic[S, M, R]):
    """A message kind of a service over state of type ``S``.

    ``handle(state, message)`` and ``undo(state, message, reply)`` are the state's own
    methods, named through its class (``PoolState.admit``); `bind` looks them up on the
    state by name, so a subclass's override (or a test's patch) is the one that runs.
    ``gives_back``, ``waits`` and ``ordered`` are `Handler`'s.
    """

    request: type[M]
    reply: type[R]
    handle: Callable[[S, M], R | Wait]
    undo: Callable[[S, M, R], None] | None = None
    gives_back: bool = False
    waits: Callable[[M], bool] | None = None
    ordered: bool = False

    def bind(self, state: S) -> Handler[M, R]:
        """The `Handler` of this kind over ``state`` (bound methods: no extra call)."""
        undo = None if self.undo is None else getattr(state, self.undo.__name__)
        return Handler(
            getattr(state, self.handle.__name__),
            undo=undo,
            gives_back=self.gives_back,
            waits=self.waits,
            ordered=self.ordered,
        )


def handler_table(
    operations: Iterable[Operation[S, Any, Any]], state: S
) -> dict[type[Any], Handler[Any, Any]]:
    """One `Handler` per declared kind, over ``state``; a kind declared twice raises
    `InvalidArgumentError`."""
    table: dict[type[Any], Handler[Any, Any]] = {}
    for operation in operations:
        if operation.request in table:
            raise InvalidArgumentError(
                f"message kind {operation.request.__name__} is declared twice"
            )
        table[operation.request] = operation.bind(state)
    return table


__all__ = ["Operation", "handler_table"]
