"""When a simulation sends each request: open loop by timestamp, or closed loop.

*Open loop* (the default): a session (a trace's request is a session of one turn)
arrives at its ``arrival_s`` divided by ``arrival_speedup_ratio`` (Dynamo's
``--arrival-speedup-ratio``: 2 halves every timestamp).

*Closed loop* (``concurrency`` N, Dynamo's ``--replay-concurrency``): N sessions are in
flight at once; the first N are sent at time 0 and each next one the moment a session
in flight settles (its last turn finished or was rejected). Timestamps only order the
workload: they are not read, so neither is the speedup ratio. (Measured on Dynamo 1.6's
offline replay: with concurrency 1 a trace's 10 ms and 5 s gaps vanish, each request
arriving as the one before it finishes; a multi-turn session holds its slot through
its inter-turn delays.)

Either way a session's later turns are sent ``delay_s`` after the turn before settled,
so a multi-turn workload reacts to the engines: the simulation tells `Arrivals` every
request that settles (`settled`) and must not step an engine past a moment at which a
request may still be released (`reactive`).

setup.py compiles this module with mypyc, with the loop that asks it at every turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence, Sized
from itertools import count

from kvpool.errors import InvalidArgumentError
from kvpool.workloads.session import Session
from kvpool.workloads.spec import RequestSpec


class Arrivals:
    """The requests of ``workload`` (requests or `Session`\\ s, ordered by arrival), each
    with the simulated time it is sent.

    ``peek`` is the time of the next request that can be sent now (None: none until a
    request in flight settles, or none left), ``pop`` takes it. Raises
    `InvalidArgumentError` for a bad argument, and from ``peek`` when the open-loop
    workload goes back in time.
    """

    def __init__(
        self,
        workload: Iterable[RequestSpec | Session],
        *,
        concurrency: int | None = None,
        arrival_speedup_ratio: float = 1.0,
    ) -> None:
        if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
            raise InvalidArgumentError(f"concurrency must be an int >= 1, got {concurrency!r}")
        ratio = arrival_speedup_ratio
        if not isinstance(ratio, int | float) or not 0 < ratio < float("inf"):
            raise InvalidArgumentError(
                f"arrival_speedup_ratio must be a finite number > 0, got {ratio!r}"
            )
        if isinstance(workload, Sequence):
            self.total = sum(_turns(item) for item in workload)
        else:
            self.total = len(workload) if isinstance(workload, Sized) else 0
        self.concurrency = concurrency
        self._ratio = float(ratio)
        self._source = iter(workload)
        self._next: RequestSpec | Session | None = next(self._source, None)
        self._last = 0.0  # the latest arrival read (open loop: they must not go back)
        self._slots = [0.0] * concurrency if concurrency is not None else []
        # (time, tie, session, index): rest[index] of session is sent at time
        self._later: list[tuple[float, int, Session, int]] = []
        self._tie = count()
        # a request in flight whose settling sends something: its session and the
        # index in ``rest`` of its next turn
        self._watched: dict[str, tuple[Session, int]] = {}

    @property
    def reactive(self) -> bool:
        """True while a request may yet be released by one that settles."""
        return self.concurrency is not None or bool(self._watched)

    def peek(self) -> float | None:
        """When the next request that can be sent now is sent; None if none can."""
        start = self._next_start()
        if self._later and (start is None or self._later[0][0] <= start):
            return self._later[0][0]
        return start

    def pop(self) -> tuple[RequestSpec, float]:
        """The next request and the time it is sent (call after `peek` gave a time)."""
        start = self._next_start()
        if self._later and (start is None or self._later[0][0] <= start):
            when, _, session, index = heapq.heappop(self._later)
            spec = session.rest[index]
            self._watch(spec, session, index + 1)
            return spec, when
        item = self._next
        if item is None or start is None:
            raise RuntimeError("pop() with nothing to send")
        if self._slots:
            heapq.heappop(self._slots)
        self._next = next(self._source, None)
        if isinstance(item, Session):
            self._watch(item.first, item, 0)
            return item.first, start
        if self.concurrency is not None:
            self._watched[item.request_id] = (Session(item), 0)
        return item, start

    def settled(self, request_id: str, when: float) -> None:
        """``request_id`` finished or was rejected at ``when``: release what waited on it."""
        watched = self._watched.pop(request_id, None)
        if watched is None:
            return
        session, index = watched
        if index < len(session.rest):
            heapq.heappush(self._later, (when + session.delay_s, next(self._tie), session, index))
        elif self.concurrency is not None:
            heapq.heappush(self._slots, when)

    def unsent(self) -> int:
        """Requests never sent (counted now; the rest of the workload is read)."""
        left = sum(len(s.rest) - i for _, _, s, i in self._later)
        left += sum(len(s.rest) - i for s, i in self._watched.values())
        while self._next is not None:
            left += _turns(self._next)
            self._next = next(self._source, None)
        return left

    def _watch(self, spec: RequestSpec, session: Session, index: int) -> None:
        if index < len(session.rest) or self.concurrency is not None:
            self._watched[spec.request_id] = (session, index)

    def _next_start(self) -> float | None:
        item = self._next
        if item is None:
            return None
        if self.concurrency is not None:
            return self._slots[0] if self._slots else None
        arrival = item.arrival_s
        if arrival < self._last:
            first = item.first if isinstance(item, Session) else item
            raise InvalidArgumentError(
                f"requests must be ordered by arrival time: {first.request_id} "
                f"arrives at {arrival}s, after one at {self._last}s"
            )
        self._last = arrival
        return arrival / self._ratio if self._ratio != 1.0 else arrival


def _turns(item: RequestSpec | Session) -> int:
    return item.num_turns if isinstance(item, Session) else 1
