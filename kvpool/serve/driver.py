"""One engine per data-parallel rank, owned by one task: the `EngineDriver`.

The driver's task runs the rank's `kvpool.engine.loop.EngineLoop`, the loop
``kvpool simulate`` runs too, over one engine (vLLM runs an engine core per
data-parallel rank, and a rank waiting on its KV actor must not stall the others); the
driver is that loop's source (the live intake below) and its step hook (outputs to
outboxes, then the gauges). The task is the only code that touches its `MockEngine`
(and, through it, the rank's KV manager actor). HTTP handlers reach it through an
anyio memory object stream of `Submit` and `Abort` messages (and a shutdown's
`AbortAll`); each request gets its tokens back through its own `Outbox` of `Output`.
Both are unbounded, so a handler never blocks on the engine and the engine never blocks
on a slow client (a request's output is bounded by its ``max_tokens``).

Timing: with ``speedup_ratio`` R > 0, simulated time runs R times wall time from the
moment the driver starts; after each step the driver sleeps until the wall clock
reaches the step's end (``start + clock / R``) and only then sends the step's tokens,
so a token is sent when the simulated clock passes the end of its step. An idle
engine's clock jumps to "now" when a request arrives. ``worst_lag_s`` records how late
(wall seconds) a step's tokens were sent past that instant, and ``lag_counts`` how many
steps were late by each whole number of milliseconds (rounded up; 0: on time). With R = 0 the engine
runs as fast as it can, yielding to the event loop after every step.

Invariants: a request is in ``_live`` from its `Submit` until its last `Output` is
sent or it is aborted; ``outstanding`` counts submitted requests not yet finished,
rejected or aborted (what data-parallel dispatch balances).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from kvpool.actors.slots import SlotKind, current_slots
from kvpool.engine import EngineConfig, MockEngine, StepResult, open_actor_kv
from kvpool.engine.admission import rejection_reason
from kvpool.engine.clock import WallPacer
from kvpool.engine.dispatch import bind, make_policy
from kvpool.engine.loop import EngineLoop
from kvpool.events import EventSink
from kvpool.serve.metrics import RankMetrics, ServeMetrics
from kvpool.serve.outbox import Outbox
from kvpool.workloads import RequestSpec


@dataclass(frozen=True, slots=True)
class Output:
    """What one step produced for one request: its new token ids (one per step), the
    prompt tokens its first admission reused from the prefix cache, and whether it is
    done (its last `Output`). ``error`` is set, with no tokens, if the engine refused it."""

    token_ids: list[int]
    cached_tokens: int
    finished: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """Queue ``spec``; its outputs go to ``reply`` (ended after the last one)."""

    spec: RequestSpec
    reply: Outbox[Output]
    sent_at: float
    """``time.perf_counter()`` when it was sent: its arrival. A request sent while a
    step runs is handled after the step, and waited for it (its queue time, as vLLM
    stamps arrival in its API server before the engine core takes the request)."""


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request whose client went away; its blocks are freed leaf first."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Drop every request the driver has (a shutdown's deadline passed): each counts as
    finished with reason ``abort``, as vLLM's engine core reports the requests its
    shutdown aborts."""


_Message = Submit | Abort | AbortAll


class _Live:
    """A request the driver is producing for."""

    __slots__ = (
        "arrival",
        "cached",
        "first_token",
        "last_token",
        "prompt_tokens",
        "reply",
        "scheduled",
        "sent",
    )

    def __init__(self, spec: RequestSpec, arrival: float, reply: Outbox[Output]) -> None:
        self.arrival = arrival  # simulated time it arrived (its latencies' start)
        self.prompt_tokens = spec.input_length
        self.reply = reply
        self.sent = 0  # output tokens already sent
        self.cached: int | None = None  # prompt tokens reused at first admission
        self.last_token: float | None = None  # simulated time of the last token
        self.first_token = 0.0  # simulated times of the first token, first admission
        self.scheduled = 0.0


class EngineDriver:
    """The task that owns one rank's engine (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        *,
        speedup_ratio: float = 1.0,
        sink: EventSink | None = None,
        metrics: ServeMetrics | None = None,
    ) -> None:
        if not speedup_ratio >= 0 or math.isinf(speedup_ratio):
            raise ValueError(f"speedup_ratio must be a finite number >= 0, got {speedup_ratio}")
        self.config = config
        self.rank = rank
        self.speedup_ratio = speedup_ratio
        self.sink = sink
        self.metrics = metrics
        self._metrics: RankMetrics | None = None if metrics is None else metrics.rank(rank)
        self.outstanding = 0
        self.pacer = WallPacer(speedup_ratio)  # its lag counts: paced steps by lateness
        self.leaked_blocks: int | None = None  # set when the task ends
        self.shutdown_aborted = 0  # requests dropped by `abort_all`
        self.engine: MockEngine | None = None
        self._send, self._receive = anyio.create_memory_object_stream[_Message](math.inf)
        self._live: dict[str, _Live] = {}
        self._seen = (0, 0, 0, 0)  # preemptions, queries, hits, generated: last reported
        self._slots: SlotKind | None = None  # the loop's wake-up path, for the outboxes
        self._stopped: set[str] = set()  # requests their clients stopped (`stop`)
        self._open = True  # the intake stream has not ended
        self._engine_loop: EngineLoop  # set by `run`, before any message is handled

    # ------------------------------------------------------------ handler side

    def submit(self, spec: RequestSpec) -> Outbox[Output]:
        """Queue ``spec`` for this rank; return the `Outbox` its outputs arrive in.

        Never blocks. Raises ``anyio.ClosedResourceError`` once `close` was called (the
        server is shutting down). Close the outbox to stop listening; the driver then
        aborts the request at its next output.
        """
        if self._slots is None:
            self._slots = current_slots()
        outbox = Outbox[Output](self._slots)
        self._send.send_nowait(Submit(spec, outbox, time.perf_counter()))
        self.outstanding += 1
        return outbox

    def abort(self, request_id: str) -> None:
        """Ask the task to drop ``request_id`` (no-op if it has finished). Never blocks
        or raises, so it is safe in a ``finally`` of a cancelled handler."""
        # shutting down: the closed reply stream makes the task abort it instead
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(Abort(request_id))

    def stop(self, request_id: str) -> None:
        """Like `abort`, for a request its client ended on a stop string or token: if
        the engine has not finished it by then, it counts as finished with
        ``finished_reason="stop"``, as vLLM counts a stop. (Marked here, at once, since
        the request may be dropped at its next output, before its `Abort` is read.)"""
        self._stopped.add(request_id)
        self.abort(request_id)

    def abort_all(self) -> None:
        """Ask the task to drop every request it has (their outboxes end without a last
        output). Never blocks or raises."""
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(AbortAll())

    def close(self) -> None:
        """Accept no more requests; the task finishes the ones it has, then ends."""
        self._send.close()

    # --------------------------------------------------------------- the task

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the rank's KV manager actor and engine, signal ready, serve until
        `close` and every request is done, then check for leaked blocks
        (``leaked_blocks``). Cancellation ends it at once (the actor is closed)."""
        async with self._open_engine() as engine:
            task_status.started()
            await self._loop(engine)
            usage = await engine.final_usage()
            self.leaked_blocks = usage.num_active

    @asynccontextmanager
    async def _open_engine(self) -> AsyncIterator[MockEngine]:
        # Dynamo's token hashes, events or not: a server's blocks are named as a router
        # names them (run keys are for simulations, whose hashes never leave them).
        async with open_actor_kv(self.config, self.rank, run_keys=False) as kv:
            engine = MockEngine(kv, self.config, rank=self.rank, sink=self.sink)
            self.pacer.start()
            engine.epoch = time.time()
            if self.speedup_ratio > 0:  # paced: ts is the wall-clock time a step ends
                engine.ts_scale = 1 / self.speedup_ratio
            self.engine = engine
            yield engine

    async def _loop(self, engine: MockEngine) -> None:
        """The rank's `EngineLoop` (N = 1), this driver its source and step hook."""
        # one engine: the cycle over one (it needs no load updates); the choice between
        # ranks is `ServeState.choose`'s
        dispatcher = bind(make_policy("round-robin"), [engine])
        self._engine_loop = EngineLoop([engine], dispatcher, pace=self._pace)
        await self._engine_loop.run(self, self._stepped)

    # ----------------------------------------- the loop's source (the live intake)

    @property
    def reactive(self) -> bool:
        """A settled request never releases another here: clients send what they send."""
        return False

    def next_arrival(self) -> float | None:
        """Due at once (``-inf``) while a message waits, or while the engine is idle and
        the stream is open (`take` then waits for one); None otherwise: step first."""
        if not self._open:
            return None
        engine = self._engine_loop.engines[0]
        if not engine.has_work or self._receive.statistics().current_buffer_used:
            return -math.inf
        return None

    async def take(self, loop: EngineLoop) -> None:
        """Handle the messages that arrived (waiting for one if the engine is idle),
        then report the engine as it now stands: the messages changed the queues (an
        abort, the pool too), and the next step may be far off (or never come: an
        engine its clients all left is idle)."""
        receive = self._receive
        handled = False
        if not loop.engines[0].has_work:
            try:
                await self._handle(await receive.receive())
                handled = True
            except anyio.EndOfStream:
                self._open = False
                return
        while self._open:  # everything that arrived meanwhile, without waiting
            try:
                message = receive.receive_nowait()
            except anyio.WouldBlock:
                break
            except anyio.EndOfStream:
                self._open = False
                break
            await self._handle(message)
            handled = True
        if handled:
            self._report(loop.engines[0])

    async def _stepped(self, index: int, engine: MockEngine, result: StepResult | None) -> None:
        """The step hook: the step's outputs to their outboxes, then the gauges."""
        assert result is not None  # serve never fast-forwards
        await self._deliver(engine, result)
        self._report(engine)

    async def _handle(self, message: _Message) -> None:
        if isinstance(message, Abort):
            await self._abort(message.request_id)
            return
        if isinstance(message, AbortAll):
            for request_id in list(self._live):
                await self._abort(request_id)
                self.shutdown_aborted += 1
                if self.metrics is not None:
                    self.metrics.success.labels(
                        self.metrics.model_name, str(self.rank), "abort"
                    ).inc()
            return
        spec, reply = message.spec, message.reply
        paced = self.speedup_ratio > 0
        now = self.pacer.now(message.sent_at) if paced else None
        loop = self._engine_loop
        engine = loop.engines[0]
        # an idle engine's clock catches up with the wall first (`EngineLoop.submit`)
        _, accepted = await loop.submit(spec, now)
        arrival = engine.clock if now is None else min(now, engine.clock)  # as submit's
        if not accepted:
            reason = rejection_reason(self.config, spec) or "rejected"
            reply.put(Output([], 0, True, reason))
            reply.end()
            self.outstanding -= 1
            return
        self._live[spec.request_id] = _Live(spec, arrival, reply)

    async def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        stopped = request_id in self._stopped
        self._stopped.discard(request_id)
        if live is None:
            return  # finished (or aborted) already
        if stopped and self._metrics is not None and live.last_token is not None:
            self._metrics.finished(
                arrival=live.arrival,
                scheduled=live.scheduled,
                first_token=live.first_token,
                last_token=live.last_token,
                prompt_tokens=live.prompt_tokens,
                generation_tokens=live.sent,
                reason="stop",
            )
        live.reply.end()
        await self._engine_loop.abort(0, request_id)
        self.outstanding -= 1

    async def _pace(self, clock: float) -> None:
        if self.speedup_ratio == 0:
            await anyio.lowlevel.checkpoint()  # let the handlers run between steps
            return
        await self.pacer.pace(clock)

    @property
    def worst_lag_s(self) -> float:
        """The latest (wall seconds) a paced step's tokens were sent past its end."""
        return self.pacer.worst_lag_s

    @worst_lag_s.setter
    def worst_lag_s(self, value: float) -> None:  # a sampler resets it between reads
        self.pacer.worst_lag_s = value

    @property
    def lag_counts(self) -> Counter[int]:
        """Paced steps by lateness in whole milliseconds, rounded up (0: on time)."""
        return self.pacer.lag_counts

    async def _deliver(self, engine: MockEngine, result: StepResult) -> None:
        """Send each scheduled request the tokens it sampled in this step (its
        `RequestOutput`)."""
        metrics = self._metrics
        clock = result.clock
        step_start = clock - result.duration_s
        gone: list[str] = []
        iteration = 0  # vLLM's iteration tokens: prompt tokens computed plus generated
        for out in result.outputs:
            request_id = out.request_id
            live = self._live.get(request_id)
            if live is None:
                continue
            num_new = out.num_computed_tokens
            if live.cached is None and out.num_cached_tokens is not None:
                # first admission: what it reused of its prompt
                live.cached = out.num_cached_tokens
                live.scheduled = step_start
                if metrics is not None:
                    metrics.queue.observe(step_start - live.arrival)
                    metrics.prompt_tokens.inc(live.prompt_tokens)
            tokens = out.new_token_ids
            generated = len(tokens)
            iteration += num_new  # a decode's one token; else its prompt and first token
            if not generated:
                continue  # a prefill chunk, or a recomputation after preemption
            if live.last_token is None or num_new != generated:
                iteration += generated
            if not live.reply.listening:
                # the client left: an abort, never a success (vLLM's output processor
                # drops an aborted request's state, so no finished-request stats)
                gone.append(request_id)
                continue
            live.sent += generated
            finished = out.finish_reason is not None
            if live.last_token is None:
                live.first_token = clock
            if metrics is not None:
                if live.last_token is None:
                    metrics.ttft.observe(clock - live.arrival)
                else:
                    metrics.itl.observe(clock - live.last_token)
                if finished:
                    metrics.finished(
                        arrival=live.arrival,
                        scheduled=live.scheduled,
                        first_token=live.first_token,
                        last_token=clock,
                        prompt_tokens=live.prompt_tokens,
                        generation_tokens=live.sent,
                    )
            live.last_token = clock
            if not live.reply.put(Output(tokens, live.cached or 0, finished)):
                gone.append(request_id)  # the client stopped listening
                continue
            if finished:
                live.reply.end()
                del self._live[request_id]
                self.outstanding -= 1
        if metrics is not None and iteration:
            metrics.iteration_tokens.observe(iteration)
        for request_id in gone:
            await self._abort(request_id)

    def _report(self, engine: MockEngine) -> None:
        """Update the rank's gauges and counters from the engine as it stands now (it is
        called after every batch of messages and every step: no change goes unreported),
        and drop the engine's per-step and per-request samples and records (a server
        runs indefinitely; nothing here reads them)."""
        stats = engine.stats
        metrics = self._metrics
        if metrics is not None:
            # the pool as it is now, aborts included (a step's own sample predates the
            # aborts of the clients that left while it ran); -1 before any step: empty
            usage = max(0, engine.num_active_blocks) / engine.config.num_gpu_blocks
            metrics.running.set(len(engine.running))
            metrics.waiting.set(len(engine.waiting))
            metrics.usage.set(usage)
            metrics.gpu_usage.set(usage)
            now = (
                stats.preemptions,
                stats.prefix_query_tokens,
                stats.prefix_hit_tokens,
                stats.generated_tokens,
            )
            seen, self._seen = self._seen, now
            preempted, queries, hits, generated = (a - b for a, b in zip(now, seen, strict=True))
            if preempted:
                metrics.preemptions.inc(preempted)
            if queries:
                metrics.queries.inc(queries)
                metrics.gpu_queries.inc(queries)
            if hits:
                metrics.hits.inc(hits)
                metrics.gpu_hits.inc(hits)
            if generated:
                metrics.generation_tokens.inc(generated)
        stats.clear_samples()


__all__ = ["Abort", "AbortAll", "EngineDriver", "Output", "Submit"]
