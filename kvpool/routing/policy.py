"""What a router is given and what it answers: `WorkerLoad`, `DispatchPolicy`, `RouterSettings`.

This module states the router contract once; the engine's dispatch point calls it and
every built-in router (`kvpool.routing.kv`, `kvpool.routing.llmd`) implements it, as a
user's router loaded with ``--dispatch package.module:factory`` does
(`kvpool.routing.plugin`).

Calls, all on one thread, in simulated time order (``now`` never decreases):

- ``choose(request, loads, now)`` once per request when it is dispatched: the index of the
  worker that gets it. ``loads`` holds one `WorkerLoad` per worker, in index order.
- ``observe(worker, events, now)``: a batch of that worker's KV events
  (`kvpool.events.BlockStored`, `BlockRemoved`, `AllBlocksCleared`), in publish order,
  ``now`` being when the router receives it (the step's end, plus
  ``--router-event-delay-ms``).
- ``finished(worker, request_id, now)``: the request finished (or was aborted) on that
  worker at ``now``.

A router is told nothing from its future: batches and finishes are delivered by
`kvpool.routing.delivery.Delivery` only once simulated time reaches them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvpool.events import KVEvent
from kvpool.workloads import RequestSpec


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a router may read of one worker now, as its ``/metrics`` would show it.

    ``active_blocks`` is the pool's blocks in use by requests (vLLM's
    ``kv_cache_usage_perc`` times ``capacity``), ``capacity`` its total blocks.
    """

    index: int
    num_running: int
    num_waiting: int
    active_blocks: int
    capacity: int

    @property
    def kv_usage(self) -> float:
        """Active blocks over capacity, in [0, 1]."""
        return self.active_blocks / self.capacity if self.capacity else 0.0


class DispatchPolicy(Protocol):
    """A router: picks a worker per request, learns from KV events and finishes."""

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        """The index (into ``loads``) of the worker that gets ``request``."""
        ...

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        """Worker ``worker`` published ``events`` (delivered at ``now``)."""
        ...

    def finished(self, worker: int, request_id: str, now: float) -> None:
        """Request ``request_id`` left worker ``worker`` at ``now``."""
        ...


@runtime_checkable
class ReportsOverlap(Protocol):
    """A router that can say how many prompt blocks it saw cached on the worker it chose
    (what ``--requests-jsonl`` records as ``router_overlap_blocks``)."""

    def overlap_seen(self, request_id: str) -> int | None:
        """The overlap (in blocks) behind ``request_id``'s choice, None if unknown."""
        ...


def uses_kv_events(policy: object) -> bool:
    """Whether ``policy`` reads KV events: its ``uses_kv_events`` attribute, True when it
    has none (a router that never reads them should say so: events cost work)."""
    return bool(getattr(policy, "uses_kv_events", True))


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What a router factory is given: the fleet's shape and the run's knobs.

    ``config`` is ``--router-config`` parsed (a JSON object; each router documents the
    keys it takes and refuses the others); ``seed`` makes any random choice
    reproducible.
    """

    num_workers: int
    block_size: int
    seed: int = 0
    config: Mapping[str, object] = field(default_factory=dict)
