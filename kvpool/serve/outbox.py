"""One request's outputs on their way from its rank's engine driver to its HTTP handler.

The driver's task puts, one handler task reads. An `Outbox` is a deque plus, while its
reader waits on an empty one, that task's reply slot (`kvpool.actors.slots`, the wake-up
path the pool actor's callers use): a put is an append and at most one wake-up, and a
read of a waiting output costs nothing. An anyio memory object stream does the same job
with a backend lookup on every call and a checkpoint on every read, which cost more than
the rest of a streamed token's path in the server (benchmarks/README.md, "Serving").

Reads raise anyio's own exceptions, as a memory stream's would: `anyio.WouldBlock` (none
yet), `anyio.EndOfStream` (the driver ended it and every output was read) and
`anyio.ClosedResourceError` (read after the reader's own `close`). Only a read that
waits is a cancel point. Unbounded: a request's outputs are bounded by its
``max_tokens``.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from kvpool.actors.slots import ReplySlot, SlotKind

_T = TypeVar("_T")


class Outbox(Generic[_T]):
    """A request's outputs: the driver `put`s and `end`s, its reader `receive`s and
    `close`s (see the module doc)."""

    __slots__ = ("_ended", "_items", "_listening", "_slot", "_slots")

    def __init__(self, slots: SlotKind) -> None:
        self._slots = slots
        self._items: deque[_T] = deque()
        self._slot: ReplySlot | None = None  # the reader's, while it waits
        self._ended = False
        self._listening = True

    # ------------------------------------------------------------ driver side

    def put(self, item: _T) -> bool:
        """Queue ``item`` for the reader and wake it; False, queuing nothing, once the
        reader has closed. Raises `anyio.ClosedResourceError` after `end`."""
        if self._ended:
            raise anyio.ClosedResourceError
        if not self._listening:
            return False
        self._items.append(item)
        self._wake()
        return True

    def end(self) -> None:
        """No more outputs: the reader gets `anyio.EndOfStream` once it has read the rest."""
        self._ended = True
        self._wake()

    @property
    def listening(self) -> bool:
        """False once the reader has closed (its client went away)."""
        return self._listening

    def _wake(self) -> None:
        slot = self._slot
        if slot is not None:
            self._slot = None
            if not slot.cancelled():
                slot.set_result(None)

    # ------------------------------------------------------------ reader side

    def receive_nowait(self) -> _T:
        """The next output if one is queued; raises `anyio.WouldBlock` if none is yet,
        `anyio.EndOfStream` if none will come."""
        if self._items:
            return self._items.popleft()
        if not self._listening:
            raise anyio.ClosedResourceError
        if self._ended:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> _T:
        """The next output, waiting for it if none is queued (a cancel point then, and
        only then); raises `anyio.EndOfStream` once none will come."""
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                pass
            slot = self._slots.open(True)
            if slot is None:  # the reader's scope is cancelled: raise it
                await anyio.lowlevel.checkpoint()
                continue
            self._slot = slot
            try:
                await slot
            except BaseException:
                if self._slot is slot:
                    self._slot = None
                self._slots.abandon(slot)
                raise

    def close(self) -> None:
        """Stop reading: queued outputs are dropped and later `put`s refused."""
        self._listening = False
        self._items.clear()

    def __aiter__(self) -> Outbox[_T]:
        return self

    async def __anext__(self) -> _T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


__all__ = ["Outbox"]
