"""The routers' views and delivery: prefix overlap, TTL and LRU views, delayed events,
and that kvpool's event hashes are what Dynamo's indexer would compute."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from kvpool.engine import EngineConfig, run_simulation
from kvpool.events import BlockStored, EventCollector, KVEvent
from kvpool.hashing import block_hashes
from kvpool.routing import (
    Delivery,
    EventView,
    KvRouter,
    LruView,
    PredictedView,
    RouterSettings,
    WorkerLoad,
)
from kvpool.workloads import RequestSpec, Segment, SyntheticWorkload


def test_overlap_stops_at_the_first_missing_block() -> None:
    view = EventView()
    view.apply([BlockStored([1, 2, 4], None, [0] * 12, 4)])
    assert view.overlap([1, 2, 3, 4]) == 2
    assert view.overlap([5, 1]) == 0
    assert view.overlap([]) == 0


def test_predicted_view_expires_after_its_ttl() -> None:
    view = PredictedView(ttl_s=2.0)
    view.routed([1, 2], now=0.0)
    view.routed([1], now=1.5)
    assert view.overlap([1, 2], now=1.9) == 2
    assert view.overlap([1, 2], now=2.5) == 1  # 2 expired at 2.0, 1 refreshed to 3.5
    assert view.overlap([1, 2], now=3.5) == 0


def test_lru_view_keeps_the_most_recent() -> None:
    view = LruView(capacity=3)
    view.routed([1, 2, 3])
    view.routed([1, 4])  # 2 is the least recent now, and goes
    assert view.overlap([1, 2]) == 1
    assert view.overlap([3, 1, 4]) == 3


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        self.calls.append(("choose", -1, now))
        return 0

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        self.calls.append(("observe", worker, now))

    def finished(self, worker: int, request_id: str, now: float) -> None:
        self.calls.append(("finished", worker, now))


def test_delivery_withholds_what_is_not_due() -> None:
    recorder = Recorder()
    delivery = Delivery(recorder, event_delay_s=0.5)
    request = RequestSpec("r", 0.0, (Segment(1, 4),), Segment(2, 1))
    delivery.observe(1, [], 1.0)  # due 1.5
    delivery.finished(0, "x", 1.2)  # due 1.2: finishes are not delayed
    delivery.observe(0, [], 0.8)  # due 1.3
    delivery.choose(request, [], 1.0)
    assert recorder.calls == [("choose", -1, 1.0)]
    delivery.choose(request, [], 1.4)
    assert recorder.calls[1:] == [("finished", 0, 1.2), ("observe", 0, 1.3), ("choose", -1, 1.4)]
    delivery.choose(request, [], 2.0)
    assert recorder.calls[4:] == [("observe", 1, 1.5), ("choose", -1, 2.0)]


def test_event_hashes_are_dynamo_hashes_of_their_tokens() -> None:
    collectors = [EventCollector(), EventCollector()]
    config = EngineConfig(num_gpu_blocks=256, block_size=16, enable_kv_cache_events=True)
    requests = list(SyntheticWorkload(num_sessions=6).requests())
    router = KvRouter(RouterSettings(num_workers=2, block_size=16))

    async def go() -> None:
        await run_simulation(requests, config, workers=2, dispatch=router, sinks=collectors)

    anyio.run(go)
    checked = 0
    for collector in collectors:
        for event in collector.events():
            if isinstance(event, BlockStored):
                hashes = block_hashes(event.token_ids, 16, event.parent_block_hash)
                assert hashes == event.block_hashes
                checked += len(hashes)
    assert checked > 0
