"""Run a workload on N engines, each with its own KV client, and build the report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from kvpool.engine.config import EngineConfig
from kvpool.engine.dispatch import Dispatch, RoutedDispatch
from kvpool.engine.engine import MockEngine
from kvpool.engine.goodput import Sla
from kvpool.engine.kv_client import KvClient, LocalKvClient
from kvpool.engine.report import Report, build_report
from kvpool.engine.routing_report import routing_summary
from kvpool.engine.simulation import ProgressCallback, Simulation
from kvpool.errors import InvalidArgumentError
from kvpool.events import EventSink
from kvpool.manager import open_manager
from kvpool.routing import DispatchPolicy, uses_kv_events
from kvpool.workloads import RequestSpec
from kvpool.workloads.session import Session

KvFactory = Callable[[EngineConfig, int], AbstractAsyncContextManager[KvClient]]
"""Opens the KV client of one engine, given the config and the engine's rank."""


@asynccontextmanager
async def open_local_kv(
    config: EngineConfig, rank: int = 0, *, run_keys: bool | None = None
) -> AsyncIterator[KvClient]:
    """A `LocalKvClient` over a fresh pool and manager sized by ``config``. ``run_keys``
    (`KvManager`'s; None: when KV events are off, since no hash then leaves the
    process) names blocks by run keys, so a workload's tokens are never built."""
    yield LocalKvClient.create(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_kv_cache_events=config.enable_kv_cache_events,
        run_keys=not config.enable_kv_cache_events if run_keys is None else run_keys,
    )


@asynccontextmanager
async def open_actor_kv(
    config: EngineConfig, rank: int = 0, *, run_keys: bool | None = None
) -> AsyncIterator[KvClient]:
    """A `kvpool.manager.ManagerClient`: the manager behind its own actor (started and
    stopped with the context): a turn per allocation, and a `FinishStep` for a step that
    finished or preempted a request. ``run_keys`` as in `open_local_kv`."""
    async with open_manager(
        config.num_gpu_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_kv_cache_events=config.enable_kv_cache_events,
        run_keys=not config.enable_kv_cache_events if run_keys is None else run_keys,
    ) as kv:
        yield kv


KV_BACKENDS: dict[str, KvFactory] = {"actor": open_actor_kv, "local": open_local_kv}
"""``--kv-backend``: the manager behind a manager actor per engine, or called inline."""


@dataclass(frozen=True, slots=True)
class SimulationRun:
    """A finished run: its engines (with their stats and samples), its report, and the
    router that dispatched it (None for least-loaded or round-robin)."""

    engines: list[MockEngine]
    report: Report
    router: RoutedDispatch | None = None


async def run_simulation(
    requests: Iterable[RequestSpec | Session],
    config: EngineConfig,
    *,
    workers: int = 1,
    dispatch: Dispatch | DispatchPolicy = "least-loaded",
    router_event_delay_s: float = 0.0,
    router_name: str | None = None,
    speedup_ratio: float = 0.0,
    fast_forward: bool = True,
    kv_factory: KvFactory = open_local_kv,
    sinks: Sequence[EventSink | None] | None = None,
    on_progress: ProgressCallback | None = None,
    workload: str = "workload",
    settings: dict[str, object] | None = None,
    wrap_kv: Callable[[KvClient], KvClient] | None = None,
    concurrency: int | None = None,
    arrival_speedup_ratio: float = 1.0,
    max_sim_time_s: float | None = None,
    lockstep: bool = False,
    sla: Sla | None = None,
) -> SimulationRun:
    """Open ``workers`` KV clients, run the requests to completion, close the clients.

    Every engine's pool is checked (invariants, active blocks) before it is closed; the
    report carries the result. ``sinks[rank]`` receives that engine's event batches;
    ``wrap_kv`` (e.g. `TimedKvClient`) wraps each client; ``fast_forward`` is
    `Simulation`'s, and so are ``concurrency``, ``arrival_speedup_ratio``,
    ``max_sim_time_s`` and ``lockstep``; ``sla`` adds goodput to the report. Event
    batches' ``ts`` is
    wall-clock time when paced (``speedup_ratio > 0``); at full speed it is the run's
    start time plus simulated seconds. A router as ``dispatch`` (named ``router_name`` in
    the report's routing section) that reads KV events turns them on in ``config``;
    ``router_event_delay_s`` delays them to it. Raises `InvalidArgumentError`
    for a bad argument and whatever a KV client raises.
    """
    if type(workers) is not int or workers < 1:
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    if sinks is not None and len(sinks) != workers:
        raise InvalidArgumentError(f"need one sink (or None) per worker, got {len(sinks)}")
    router = None if isinstance(dispatch, str) else dispatch
    if router is not None and uses_kv_events(router) and not config.enable_kv_cache_events:
        config = dataclasses.replace(config, enable_kv_cache_events=True)
    epoch = time.time()
    async with AsyncExitStack() as stack:
        engines = []
        for rank in range(workers):
            kv = await stack.enter_async_context(kv_factory(config, rank))
            if wrap_kv is not None:
                kv = wrap_kv(kv)
            sink = sinks[rank] if sinks is not None else None
            # the report reads the engines' stats and records, not their steps' outputs
            engine = MockEngine(kv, config, rank=rank, sink=sink, epoch=epoch, step_outputs=False)
            if speedup_ratio > 0:  # paced: ts is the wall-clock time a step ends
                engine.ts_scale = 1 / speedup_ratio
            engines.append(engine)
        simulation = Simulation(
            engines,
            requests,
            dispatch=dispatch,
            router_event_delay_s=router_event_delay_s,
            speedup_ratio=speedup_ratio,
            fast_forward=fast_forward,
            on_progress=on_progress,
            concurrency=concurrency,
            arrival_speedup_ratio=arrival_speedup_ratio,
            max_sim_time_s=max_sim_time_s,
            lockstep=lockstep,
        )
        wall_s = await simulation.run()
        final = [await engine.final_usage() for engine in engines]
    report = build_report(
        engines,
        final,
        workload=workload,
        settings=settings or {},
        wall_s=wall_s,
        sla=sla,
        max_sim_time_s=max_sim_time_s,
        unfinished=simulation.unfinished,
        unstarted=simulation.unstarted,
        routing=None
        if simulation.router is None
        else routing_summary(engines, router_name or type(router).__name__, router_event_delay_s),
    )
    return SimulationRun(engines, report, simulation.router)
