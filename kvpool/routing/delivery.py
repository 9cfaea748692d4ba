"""Hands a router its KV events and finishes only once simulated time reaches them.

The engine loop learns of a step's events and finished requests when the step ends,
which may be after the arrival dispatched next (engines step on clocks of their own), so
`Delivery` queues them, stamped, and passes on to the wrapped router, before each
``choose``, those due by then: a batch at its step's end plus ``event_delay_s``
(``--router-event-delay-ms``, the transport's lag), a finish at once (a router proxies
the response stream and sees it end). Due times tie in arrival order, so each worker's
batches stay in publish order. A stamp comes back from a float timestamp, so "due"
allows `SLACK_S` of rounding.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool.events import KVEvent
from kvpool.routing.policy import DispatchPolicy, ReportsOverlap, WorkerLoad
from kvpool.workloads import RequestSpec

SLACK_S = 1e-6
"""How far past ``now`` a stamp may be and still count as due (float rounding)."""


class Delivery:
    """A `DispatchPolicy` that delays what it is told, then tells ``policy``."""

    def __init__(self, policy: DispatchPolicy, *, event_delay_s: float = 0.0) -> None:
        if not event_delay_s >= 0:
            raise ValueError(f"event_delay_s must be >= 0, got {event_delay_s!r}")
        self.policy = policy
        self.event_delay_s = event_delay_s
        # (due, sequence, worker, events or None, request id)
        self._queue: list[tuple[float, int, int, Sequence[KVEvent] | None, str]] = []
        self._sequence = 0

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        """Deliver what is due by ``now``, then ask the router."""
        self.deliver(now)
        return self.policy.choose(request, loads, now)

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        """Queue ``events`` (published at ``now``) for ``now + event_delay_s``."""
        self._push(now + self.event_delay_s, worker, events, "")

    def finished(self, worker: int, request_id: str, now: float) -> None:
        """Queue the finish for ``now``."""
        self._push(now, worker, None, request_id)

    def deliver(self, now: float) -> None:
        """Pass on, in due order, everything due by ``now``."""
        queue = self._queue
        policy = self.policy
        while queue and queue[0][0] <= now + SLACK_S:
            due, _, worker, events, request_id = heapq.heappop(queue)
            if events is None:
                policy.finished(worker, request_id, due)
            else:
                policy.observe(worker, events, due)

    def overlap_seen(self, request_id: str) -> int | None:
        """The wrapped router's, when it reports one."""
        policy = self.policy
        return policy.overlap_seen(request_id) if isinstance(policy, ReportsOverlap) else None

    def _push(self, due: float, worker: int, events: Sequence[KVEvent] | None, rid: str) -> None:
        heapq.heappush(self._queue, (due, self._sequence, worker, events, rid))
        self._sequence += 1
