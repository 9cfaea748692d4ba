"""Work that stops when its client leaves (vLLM's ``with_cancellation``).

A non-streaming request writes nothing until it is done, so only a listener on the
ASGI ``receive`` can learn that its client went away: a closed connection, or a
half-closed one (uvicorn treats a client's EOF as the connection lost, as vLLM's server
does). `unless_disconnected` runs the work beside such a listener and cancels it when
``http.disconnect`` arrives; the work's own cleanup (``finally``) then aborts what it
started. Streaming responses have their listener in `kvpool.serve.app`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
from starlette.types import Receive

_T = TypeVar("_T")


class _Outcome(Generic[_T]):
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: _T | None = None


async def unless_disconnected(
    receive: Receive, work: Callable[[], Awaitable[_T]]
) -> tuple[bool, _T | None]:
    """Run ``work()`` until it returns or the client disconnects, whichever is first;
    return ``(True, its result)`` or ``(False, None)`` (the work was cancelled).

    Call it only once the request's body has been read whole: the listener takes every
    message ``receive`` gives."""
    outcome = _Outcome[_T]()
    async with anyio.create_task_group() as tasks:

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tasks.cancel_scope.cancel()

        tasks.start_soon(listen)
        outcome.value = await work()
        outcome.done = True
        tasks.cancel_scope.cancel()  # the work is done: stop listening
    return outcome.done, outcome.value


__all__ = ["unless_disconnected"]
