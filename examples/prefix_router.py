"""A user's router for ``kvpool simulate --dispatch prefix_router:make`` and for the live
fleet of ``examples/kv_routed_fleet.py --router prefix_router:make``: the same code.

The rule: the worker whose KV events show the longest cached prefix of the prompt; among
equals (none cached, say) the one with the fewest running plus waiting requests, then the
one this router sent the fewest requests, then the lowest index. It implements
`kvpool.routing.DispatchPolicy` and builds its views from events with
`kvpool.routing.EventView`; `make` is the factory ``--dispatch`` calls.

    PYTHONPATH=examples kvpool simulate --workers 4 --dispatch prefix_router:make
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.events import KVEvent
from kvpool.routing import EventView, RouterSettings, WorkerLoad, prompt_hashes
from kvpool.workloads import RequestSpec


class LongestPrefixRouter:
    """Longest cached prefix by KV events; ties to the least busy worker."""

    uses_kv_events = True

    def __init__(self, num_workers: int, block_size: int) -> None:
        self.block_size = block_size
        self.views = [EventView() for _ in range(num_workers)]
        self.overlaps: dict[str, int] = {}
        self.sent = [0] * num_workers

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        hashes = prompt_hashes(request, self.block_size)
        overlaps = [view.overlap(hashes) for view in self.views]
        best = min(
            range(len(loads)),
            key=lambda i: (
                -overlaps[i],
                loads[i].num_running + loads[i].num_waiting,
                self.sent[i],
                i,
            ),
        )
        self.overlaps[request.request_id] = overlaps[best]
        self.sent[best] += 1
        return best

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        self.views[worker].apply(events)

    def finished(self, worker: int, request_id: str, now: float) -> None:
        pass  # loads come from the workers' metrics; nothing to forget

    def overlap_seen(self, request_id: str) -> int | None:
        return self.overlaps.get(request_id)


def make(settings: RouterSettings) -> LongestPrefixRouter:
    """The factory ``--dispatch prefix_router:make`` calls."""
    return LongestPrefixRouter(settings.num_workers, settings.block_size)
