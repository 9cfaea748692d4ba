"""What one server holds: its engine drivers (one per rank), tokenizer and metrics, and
the life cycle that starts and stops the drivers' tasks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio

from kvpool.engine import EngineConfig, LeastLoaded
from kvpool.engine.dispatch import WorkerLoad
from kvpool.events import EventSink
from kvpool.serve.driver import EngineDriver
from kvpool.serve.failures import FailureInjector
from kvpool.serve.intake import RequestLimits
from kvpool.serve.metrics import ServeMetrics
from kvpool.serve.tokenizer import BuiltinTokenizer, Tokenizer
from kvpool.workloads import RequestSpec

DEFAULT_MODEL_NAME = "kvpool-mock"


class ServeState:
    """A server's engines and settings; `running` runs the engines' tasks.

    Dispatch across data-parallel ranks is simulate's ``least-loaded``
    (`kvpool.engine.dispatch.LeastLoaded`): the rank with the fewest outstanding
    requests, lowest rank on ties.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        data_parallel_size: int = 1,
        speedup_ratio: float = 1.0,
        tokenizer: Tokenizer | None = None,
        sinks: Sequence[EventSink | None] | None = None,
        failures: FailureInjector | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if sinks is not None and len(sinks) != data_parallel_size:
            raise ValueError(f"need one sink (or None) per rank, got {len(sinks)}")
        self.config = config
        self.model_name = model_name
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else BuiltinTokenizer()
        self.limits = (limits if limits is not None else RequestLimits()).for_context(
            self.max_model_len
        )
        self.metrics = ServeMetrics(model_name, config, data_parallel_size)
        self.failures = failures  # injected failures (router tests), None: none
        self.created = int(time.time())
        self._dispatch = LeastLoaded()
        self.drivers = [
            EngineDriver(
                config,
                rank,
                speedup_ratio=speedup_ratio,
                sink=None if sinks is None else sinks[rank],
                metrics=self.metrics,
            )
            for rank in range(data_parallel_size)
        ]

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt plus output) one request may hold: the whole cache."""
        return self.config.num_gpu_blocks * self.config.block_size

    def choose(self, spec: RequestSpec) -> EngineDriver:
        """The rank for ``spec``: fewest outstanding, lowest rank on ties.

        A handler reads no engine (each is its driver's task's): a rank's load is its
        driver's ``outstanding``, the requests sent to it and not yet settled, all
        counted as waiting."""
        capacity = self.config.num_gpu_blocks
        loads = [
            WorkerLoad(rank, 0, driver.outstanding, 0, capacity)
            for rank, driver in enumerate(self.drivers)
        ]
        return self.drivers[self._dispatch.choose(spec, loads, time.monotonic())]

    @property
    def leaked_blocks(self) -> int:
        """Blocks still active after the engines stopped (0 when all is well)."""
        return sum(driver.leaked_blocks or 0 for driver in self.drivers)

    @property
    def shutdown_aborted(self) -> int:
        """Requests a shutdown's deadline aborted, over every rank."""
        return sum(driver.shutdown_aborted for driver in self.drivers)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ServeState]:
        """Start every rank's task; on exit, stop accepting requests, let the engines
        finish the ones they have, and wait for them (``leaked_blocks`` is then set)."""
        async with anyio.create_task_group() as tasks:
            for driver in self.drivers:
                await tasks.start(driver.run)
            try:
                yield self
            finally:
                for driver in self.drivers:
                    driver.close()


__all__ = ["DEFAULT_MODEL_NAME", "ServeState"]
