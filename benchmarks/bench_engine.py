"""Engine benchmark: simulated requests per wall second, and where the wall time goes.

Reproduce the figures (from the repository root, the pool core compiled as
``pip install -e .`` compiles it):

    python benchmarks/bench_engine.py            # embedded default, every KV backend
    python benchmarks/bench_engine.py --repeat 5 --workers 2
    python benchmarks/bench_engine.py --traces   # + the multi-turn, Mooncake traces (../shared)
    python benchmarks/bench_engine.py --multiturn synth.jsonl    # that trace only

**Embedded default** (always run). For each KV backend (``local``: a `KvManager` called
inline; ``actor``: the manager behind the manager actor, one actor per worker) it runs
`kvpool simulate`'s embedded default workload with the CLI's default flags and prints,
best of ``--repeat`` runs:

- wall seconds and simulated requests per wall second;
- the share of wall time spent awaiting KV calls (`TimedKvClient`): the manager, the
  pool and, for the actor, the round trip through it; the rest is the scheduler, the
  simulation loop and workload generation;
- for the actor, the share of wall time spent handling its messages (its handlers:
  manager and pool work, timed around each handler, whichever task runs it), without the task
  switches of a round trip;
- from one cProfile run: the share of (profiled) time inside the pool core, the manager
  and hashing, the actor machinery, and the engine.

Targets: the embedded default completes in under 15 s; the pool is not the bottleneck
(its share under half of wall time); the actor backend is no slower than at 92c3dcf,
before the actor became one task with one mailbox; `DIRECT_TURNS_ACTOR` is that run's
figure, measured on this machine class (reproduce it at that commit with this script).

**Traces** (only with ``--traces``, or ``--multiturn``/``--mooncake``
for one of them; skipped with a note when a file is missing: a fresh checkout has no
``../shared``). Each trace is read as ``kvpool simulate --trace`` reads it (a
`MooncakeTrace`: one pass that validates it and builds its requests, timed apart and
printed as "trace read"); one worker, uvloop, no timing wrappers, so the wall time is
the run's own (`run_simulation`):

- the multi-turn trace ``../shared/bench/gen_multiturn_trace.py --sessions 3000
  --session-rate 1.0`` writes (8,957 requests; generated into a temporary directory
  unless ``--multiturn`` names a copy), ``--num-gpu-blocks 4096``: fast-forward (the
  default) on each backend against the fixed target of 10,000 requests per wall second
  and Dynamo's replay beside it (the target now: at least its requests per second), and
  step by step (``fast_forward=False``, one run each: about a minute before 3379ac5) with
  whether its report's totals equal the fast-forward run's; then, from extra untimed
  runs (local backend, which makes the same calls), the steps simulated against the
  steps the engine took one at a time and its jumps, and the KV calls of each path by
  method (each a round trip on the actor backend);
- Mooncake's synthetic trace (``../shared/traces/mooncake_synthetic_trace.jsonl.gz``,
  3,993 requests), actor backend, fast-forward: the default ``--num-gpu-blocks`` and
  16384; at the default (``--aic-blocks 16384``: at the larger), ``--timing-model
  aic`` (Qwen3-8B on one H200, with aiconfigurator-core installed; its default context
  bucket, and exact) next to the linear model: wall time and steps (the exact
  variant's from its timed run), and, from a run with the timing model wrapped in a
  timer, the time a step spends in the model's ``duration`` (aic: its cache lookups
  and the database queries they miss,
  counted) against the linear model's.

On both traces (Mooncake's at 16384 blocks) an **engine alone** row follows: the same
run on the local backend with every KV call answered from a recording of it
(`RecordedKv`), so no manager, pool or block naming runs; its totals are checked equal to
the recorded run's. The difference from the local run is what the KV side costs: the most
any change to the manager or the pool can save (the actor's round trips come on top).

Fast variants are best of ``--repeat``; a run longer than `SLOW_S` is not repeated.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import gzip
import inspect
import math
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
from build_info import REPO, describe_build  # benchmarks/ is the script's path

from kvpool.engine import EngineConfig, KvClient, LocalKvClient, TimedKvClient, TimingModel
from kvpool.engine.report import WorkerReport
from kvpool.engine.runner import KV_BACKENDS, KvFactory, SimulationRun, run_simulation
from kvpool.hashing import BlockHasher, ChunkMemo
from kvpool.hashing.run_keys import RunKeyer, RunMemo
from kvpool.workloads import MooncakeTrace, RequestSpec, default_workload

DIRECT_TURNS_ACTOR = ("92c3dcf", 0.264)
"""(commit, best wall seconds) of the actor backend on the embedded default, with direct
turns and a deque mailbox: `run_simulation` of 92c3dcf's own build in a worktree, six
best-of-3 runs alternating with 9350aae's on the machine of the 2026-12-01 session
(0.264-0.268 s; earlier sessions' machines ran it in 0.55-0.88 s). A figure from
another machine does not compare: rebuild 92c3dcf beside this one to compare."""

SHARED = REPO.parent / "shared"
"""The shared directory beside the repository (``../shared``): traces and their generator."""
GENERATOR = SHARED / "bench" / "gen_multiturn_trace.py"
MULTITURN_ARGS = ("--sessions", "3000", "--session-rate", "1.0")
MULTITURN_BLOCKS = 4096
MOONCAKE = SHARED / "traces" / "mooncake_synthetic_trace.jsonl.gz"
MOONCAKE_BLOCKS = (EngineConfig().num_gpu_blocks, 16384)
TARGET_REQUESTS_PER_S = 10_000
"""Requests per wall second: the multi-turn trace, actor backend, fast-forward (an earlier
issue's fixed target; the current one is Dynamo's replay measured beside it:
`dynamo_row`)."""
CLI_EVENTS = False
"""``enable_kv_cache_events`` of the trace runs: what ``kvpool simulate --trace`` runs
without ``--zmq-kv-event-port`` (nobody to publish to, so no event is built; the report
counts the batches all the same). The embedded default keeps the library's default
(events built), as the runs it is compared with did."""
SLOW_S = 10.0
"""A run that takes longer than this is not repeated (the figure is then one run)."""


class ActorTurnTimer:
    """Adds up the wall time the actors spend in their handlers (manager and pool work).
    Wraps every handler of each actor created while the timer is active."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> ActorTurnTimer:
        from kvpool.actors import Actor, Handler

        original = Actor.__init__
        timed = self._timed

        def init(actor: Any, handlers: Any, slots: Any, *identity: Any) -> None:
            original(
                actor,
                {
                    kind: Handler(timed(h.handle), h.undo, h.gives_back, h.waits, h.ordered)
                    for kind, h in handlers.items()
                },
                slots,
                *identity,
            )

        self._original = original
        Actor.__init__ = init  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc_info: object) -> None:
        from kvpool.actors import Actor

        Actor.__init__ = self._original  # type: ignore[method-assign]

    def _timed(self, handle: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed_handle(message: Any) -> Any:
            start = time.perf_counter()
            try:
                return handle(message)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_handle


def run_once(
    requests: list[RequestSpec], workers: int, factory: KvFactory
) -> tuple[SimulationRun, float, float, float]:
    """One simulation: the run, its wall seconds, seconds spent awaiting KV calls, and
    seconds the manager actors spent in their turns (0 without actors)."""
    timers: list[TimedKvClient] = []

    def wrap(kv: KvClient) -> KvClient:
        timed = TimedKvClient(kv)
        timers.append(timed)
        return timed

    async def go() -> SimulationRun:
        return await run_simulation(
            requests, EngineConfig(), workers=workers, kv_factory=factory, wrap_kv=wrap
        )

    with ActorTurnTimer() as turns:
        start = time.perf_counter()
        run = anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})
        wall = time.perf_counter() - start
    return run, wall, sum(t.seconds for t in timers), turns.seconds


_GROUPS: list[tuple[str, Callable[[str], bool]]] = [
    # Compiled (mypyc) functions show up as builtins: methods of their classes, or
    # functions of their modules. A compiled function's calls into other compiled code
    # are not seen, so its own share includes them.
    ("pool core (kvpool/pool)", lambda f: "/kvpool/pool/" in f or "BlockPool" in f),
    (
        "manager + hashing",
        lambda f: (
            "/kvpool/manager/" in f
            or "/kvpool/hashing/" in f
            or "KvManager" in f
            or "RequestState" in f
        ),
    ),
    ("actor + messages", lambda f: "/kvpool/actors/" in f or "/kvpool/messages/" in f),
    (
        "engine + simulation",
        lambda f: "/kvpool/engine/" in f or "kvpool.engine." in f or "EngineRequest" in f,
    ),
    ("workload generation", lambda f: "/kvpool/workloads/" in f or "kvpool.workloads." in f),
    ("event loop, anyio, other", lambda f: True),
]


def profile_shares(requests: list[RequestSpec], workers: int, factory: KvFactory) -> None:
    """Print the share of profiled time (tottime) per part of kvpool."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(requests, workers, factory)
    profiler.disable()
    stats = pstats.Stats(profiler)
    totals = dict.fromkeys((name for name, _ in _GROUPS), 0.0)
    for (filename, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        tottime = row[2]
        where = filename if filename != "~" else function
        for name, matches in _GROUPS:
            if matches(where):
                totals[name] += tottime
                break
    grand = sum(totals.values())
    for name, seconds in totals.items():
        print(f"    {name:28s} {100 * seconds / grand:5.1f}%")


@dataclass(frozen=True, slots=True)
class Timed:
    """The best of one or more runs of the same simulation."""

    runs: int
    wall_s: float
    simulated_s: float
    total: WorkerReport

    @property
    def requests_per_s(self) -> float:
        return self.total.requests_submitted / self.wall_s

    def how(self) -> str:
        return f"best of {self.runs}" if self.runs > 1 else "one run"


def run_trace(
    requests: Iterable[RequestSpec],
    config: EngineConfig,
    backend: str,
    fast_forward: bool,
    wrap_kv: Callable[[KvClient], KvClient] | None = None,
) -> tuple[SimulationRun, float]:
    """One plain `run_simulation` (one worker, uvloop) and its wall seconds."""

    async def go() -> SimulationRun:
        return await run_simulation(
            requests,
            config,
            kv_factory=KV_BACKENDS[backend],
            fast_forward=fast_forward,
            wrap_kv=wrap_kv,
        )

    gc.collect()  # the last run's garbage is not this run's to collect
    start = time.perf_counter()
    run = anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})
    return run, time.perf_counter() - start


def best_of(repeat: int, once: Callable[[], tuple[SimulationRun, float]]) -> Timed:
    """Run ``once`` up to ``repeat`` times (once only if it takes over `SLOW_S`); keep
    the fastest run's figures, not the run itself (its samples are large)."""
    best: Timed | None = None
    for runs in range(1, repeat + 1):
        run, wall = once()
        total = run.report.total
        assert total.leaked_blocks == 0
        if best is None or wall < best.wall_s:
            best = Timed(runs, wall, run.report.simulated_s, total)
        else:
            best = Timed(runs, best.wall_s, best.simulated_s, best.total)
        del run
        if wall > SLOW_S:
            break
    assert best is not None
    return best


def jump_counts(run: SimulationRun) -> tuple[int, int]:
    """The fast-forward jumps of a run's engines and the steps they covered."""
    return (
        sum(engine.jumps for engine in run.engines),
        sum(engine.jumped_steps for engine in run.engines),
    )


class CountingKv:
    """A KV client that counts the calls of each of its methods, by name, in ``counts``
    (every other attribute is the wrapped client's)."""

    def __init__(self, inner: KvClient, counts: Counter[str]) -> None:
        self._inner = inner
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        counts = self._counts

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return attr(*args, **kwargs)

        return counted

    @staticmethod
    def wrapper(counts: Counter[str]) -> Callable[[KvClient], KvClient]:
        """A ``wrap_kv`` that counts into ``counts``."""
        return lambda kv: cast(KvClient, CountingKv(kv, counts))


class RecordedKv:
    """A KV client between the engine and ``inner`` with a log of each async call's
    ``(method, reply)``: with ``replay`` False it makes the calls and appends to ``log``;
    with ``replay`` True it answers each call with the log's next reply and does no KV
    work at all, so a run is the engine, its loop and the trace reading alone (the
    engine is deterministic: it makes the same calls in the same order, and a call out
    of order fails). Every other attribute is ``inner``'s."""

    def __init__(self, inner: KvClient, log: list[tuple[str, Any]], *, replay: bool) -> None:
        self._inner = inner
        self._log = log
        self._replies = iter(log) if replay else None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        log = self._log
        replies = self._replies

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            reply = await attr(*args, **kwargs)
            log.append((name, reply))
            return reply

        async def replayed(*_args: Any, **_kwargs: Any) -> Any:
            assert replies is not None
            method, reply = next(replies)
            if method != name:
                raise RuntimeError(f"replay out of step: {name} called, {method} recorded")
            return reply

        wrapped = recorded if replies is None else replayed
        setattr(self, name, wrapped)  # later lookups skip __getattr__
        return wrapped


def kv_share_row(
    trace: MooncakeTrace, config: EngineConfig, repeat: int, local: Timed | None = None
) -> None:
    """The local backend's run (``local``, if timed already) against the same run with
    every KV call answered from a recording of it: the engine, the loop and the trace
    alone, so the difference is what the manager, the pool and the naming of blocks
    cost (the most any change to them can save; the actor's round trips come on top)."""
    shown = local is None
    if local is None:
        local = best_of(repeat, functools.partial(run_trace, trace, config, "local", True))
    log: list[tuple[str, Any]] = []
    recorded, _ = run_trace(
        trace, config, "local", True, lambda kv: cast(KvClient, RecordedKv(kv, log, replay=False))
    )
    expected = recorded.report.total
    del recorded

    def replay() -> tuple[SimulationRun, float]:
        return run_trace(
            trace,
            config,
            "local",
            True,
            lambda kv: cast(KvClient, RecordedKv(kv, log, replay=True)),
        )

    alone = best_of(repeat, replay)
    same = "same totals" if not differences(alone.total, expected) else "totals DIFFER"
    kv_s = local.wall_s - alone.wall_s
    if shown:
        row("local, fast-forward", local)
    row(
        "engine alone",
        alone,
        f"(its {len(log):,} KV calls answered from a recording, {same}: the manager, "
        f"pool and naming take {kv_s:.2f} s, {100 * kv_s / local.wall_s:.0f}% of the local run)",
    )


CALL_SITES = (
    # a step's running slots and admissions are one `schedule` call (`allocate_steps`
    # when it admits nobody), and a new request's first admission registers it:
    # arrivals cost no call
    ("steps", ("schedule", "allocate_steps")),
    ("jumps", ("allocate_run",)),
    ("finishing jumps", ("finish_run", "finish_chain")),
    ("finishing steps", ("finish_step",)),
)
"""Where the engine's KV calls come from, and the counts each is read from."""


def calls_per_request(counts: Counter[str], requests: int) -> str:
    """The calls per request, by where they come from (`CALL_SITES`), and the rest."""
    sites = [(label, sum(counts[key] for key in keys)) for label, keys in CALL_SITES]
    named = sum(n for _, n in sites)
    total = counts.total()
    parts = [f"{label} {n / requests:.2f}" for label, n in sites]
    parts.append(f"other {(total - named) / requests:.2f}")
    return f"{total / requests:.2f} per request ({', '.join(parts)})"


def describe_calls(counts: Counter[str]) -> str:
    """``N (method n, ...)``: the total and the most frequent methods."""
    methods = counts
    top = methods.most_common(5)
    rest = methods.total() - sum(n for _, n in top)
    parts = [f"{name} {n:,}" for name, n in top] + ([f"other {rest:,}"] if rest else [])
    return f"{methods.total():,} ({', '.join(parts)})"


def differences(first: WorkerReport, second: WorkerReport) -> list[str]:
    """The names of the report fields in which two runs differ."""
    return [
        name for name in first.__struct_fields__ if getattr(first, name) != getattr(second, name)
    ]


def read_trace(path: Path) -> tuple[MooncakeTrace, float]:
    """The trace as ``kvpool simulate --trace`` opens it, and the seconds its validation
    pass took (the CLI's, before the run starts)."""
    start = time.perf_counter()
    trace = MooncakeTrace(path)
    return trace, time.perf_counter() - start


def multiturn_trace(path: Path | None, workdir: Path) -> Path | None:
    """``path``, or the multi-turn trace generated into ``workdir`` (None, with a note,
    if the generator is missing)."""
    if path is not None:
        return path
    if not GENERATOR.is_file():
        print(f"\nmulti-turn trace: skipped, no generator at {GENERATOR}")
        return None
    out = workdir / "synth.jsonl"
    subprocess.run(
        [sys.executable, str(GENERATOR), *MULTITURN_ARGS, "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def dynamo_replay(path: Path, config: EngineConfig, repeat: int) -> tuple[float, int] | None:
    """Best wall seconds (and requests completed) of NVIDIA Dynamo's own mocker replaying
    ``path`` offline with ``config``'s cache and batch limits, its other settings its own
    (its polynomial timing model among them); None without ``ai-dynamo-runtime``. Raises
    what the replay raises."""
    os.environ.setdefault("DYN_LOG", "error")  # its Rust log, read when it loads
    try:
        from dynamo._core import run_mocker_trace_replay
    except ImportError:
        return None
    engine = {
        "num_gpu_blocks": config.num_gpu_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "preemption_mode": config.preemption_mode,
    }
    best = math.inf
    completed = 0
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = run_mocker_trace_replay(
            [str(path)], extra_engine_args={"engine": engine}, trace_block_size=512
        )
        best = min(best, time.perf_counter() - start)
        completed = int(result.summary["completed_requests"])
    return best, completed


def dynamo_row(
    path: Path,
    config: EngineConfig,
    repeat: int,
    ours: Timed,
    *,
    target: bool = False,
    read_s: float = 0.0,
) -> None:
    """The side-by-side row: Dynamo's mocker on the same trace, and kvpool's ratio (also
    with ``read_s``, kvpool's trace read, added: Dynamo's replay reads its trace in its
    own wall time); with ``target``, whether kvpool's actor run (``ours``) reaches
    Dynamo's requests per second (the multi-turn trace's target)."""
    try:
        replayed = dynamo_replay(path, config, repeat)
    except Exception as exc:  # its own checks refuse some runs: say so, go on
        print(f"  Dynamo mocker, offline: failed on this trace ({exc})")
        return
    if replayed is None:
        print("  Dynamo mocker: skipped (pip install ai-dynamo-runtime, Linux, to compare)")
        return
    wall, completed = replayed
    reached = ""
    if target:
        met = "met" if ours.requests_per_s >= completed / wall else "NOT met"
        reached = f"; target: kvpool's actor at least its requests per second: {met}"
    print(
        f"  {'Dynamo mocker, offline':24s} {'best of ' + str(repeat):>10s} {wall:9.2f} s "
        f"{completed / wall:10,.0f} (ai-dynamo-runtime's Rust replay, same trace and "
        f"cache; kvpool's actor fast-forward takes {ours.wall_s / wall:.2f}x as long, "
        f"{(ours.wall_s + read_s) / wall:.2f}x with its trace read{reached})"
    )


def row(label: str, timed: Timed, note: str = "") -> None:
    print(
        f"  {label:24s} {timed.how():>10s} {timed.wall_s:9.2f} s "
        f"{timed.requests_per_s:10,.0f} {note}".rstrip()
    )


def naming_row(clients: list[KvClient], total: WorkerReport) -> None:
    """How the run named its blocks: run keys (no token built, a digest per run, not
    per block) or Dynamo's hashes, and how much their run memo
    (`kvpool.hashing.run_keys.RunMemo`) saved."""
    for kv in clients:
        if not isinstance(kv, LocalKvClient):
            continue
        manager = kv.manager
        memo = manager._run_memo  # a benchmark looks inside
        tokens = total.prompt_tokens + total.generated_tokens
        handed = f"{tokens:,} tokens ({tokens // kv.block_size:,} blocks) handed over"
        if manager.run_keys or memo is None:
            scheme = "run keys, no token built" if manager.run_keys else "no names"
            print(f"  blocks named by {scheme}: {handed}")
            continue
        print(
            f"  blocks named by Dynamo's token hashes: {handed}; whole runs of blocks "
            f"hashed {memo.misses:,} times "
            f"({memo.blocks_named:,} blocks), looked up {memo.hits:,} times"
        )


def naming_costs(requests: Iterable[RequestSpec], block_size: int) -> None:
    """Each request's prompt and output named as a manager names them (each prompt once,
    its output appended in one piece), timed per scheme, in this process: Dynamo's
    hashes from the prompt's tokens (the path before run keys: u32 arrays, a memo of
    256-token chunks' digests), the same hashes through the run memo (events on: tokens
    still built, for the events), and run keys (events off: no token built)."""
    specs = list(requests)
    tokens = sum(spec.input_length + spec.output_length for spec in specs)

    def chunked() -> None:
        memo = ChunkMemo(block_size)
        for spec in specs:
            hasher = BlockHasher(block_size, memo=memo)
            hasher.extend(spec.prompt_token_array())
            hasher.extend(spec.output.tokens())

    def memoised() -> None:
        memo = RunMemo(block_size)
        for spec in specs:
            hasher = BlockHasher(block_size)
            runs = spec.prompt_token_runs(with_tokens=True)
            hasher.extend_runs(runs, runs.to_array(), memo)
            hasher.extend(spec.output.tokens())

    def keyed() -> None:
        for spec in specs:
            keyer = RunKeyer(block_size)
            keyer.extend(spec.prompt_token_runs())
            keyer.extend_span(spec.output.seed, spec.output.length)

    print(f"  naming every block of {tokens:,} tokens ({len(specs):,} requests), best of 3:")
    for label, name in (
        ("token hashes, chunk memo (before)", chunked),
        ("token hashes, run memo (events on)", memoised),
        ("run keys (events off, the default)", keyed),
    ):
        seconds = min(timeit.repeat(name, number=1, repeat=3))
        print(f"    {label:38s} {seconds:6.2f} s")


def multiturn_section(path: Path, repeat: int, step_by_step: bool, reproduce: str) -> None:
    """The multi-turn trace: fast-forward against the target, and step by step."""
    if not path.is_file():
        print(f"\nmulti-turn trace: skipped, no file {path}")
        return
    trace, validate_s = read_trace(path)
    config = EngineConfig(num_gpu_blocks=MULTITURN_BLOCKS, enable_kv_cache_events=CLI_EVENTS)
    with trace:
        print(
            f"\nmulti-turn trace {path} ({len(trace)} requests; validated in "
            f"{validate_s:.2f} s before the run, as the CLI does, not counted below)"
        )
        print(
            f"  --num-gpu-blocks {MULTITURN_BLOCKS}, 1 worker, other flags default, uvloop; "
            f"reproduce: {reproduce}"
        )
        print(f"  {'backend, path':24s} {'runs':>10s} {'wall time':>11s} {'req/wall s':>10s}")
        fast_total: WorkerReport | None = None
        actor_fast: Timed | None = None
        local_fast: Timed | None = None
        for backend in ("actor", "local"):
            fast = best_of(repeat, functools.partial(run_trace, trace, config, backend, True))
            met = "met" if fast.requests_per_s >= TARGET_REQUESTS_PER_S else "NOT met"
            target = f"(target >= {TARGET_REQUESTS_PER_S:,}: {met})" if backend == "actor" else ""
            row(f"{backend}, fast-forward", fast, target)
            fast_total = fast.total
            if backend == "actor":
                actor_fast = fast
            else:
                local_fast = fast
            if step_by_step:
                slow = best_of(1, functools.partial(run_trace, trace, config, backend, False))
                differ = differences(fast.total, slow.total)
                if slow.simulated_s != fast.simulated_s:
                    differ.append("simulated_s")
                same = "same totals" if not differ else "totals DIFFER: " + ", ".join(differ)
                row(
                    f"{backend}, step by step",
                    slow,
                    f"(fast-forward's speedup {slow.wall_s / fast.wall_s:.1f}x; {same})",
                )
        assert fast_total is not None
        assert actor_fast is not None
        dynamo_row(path, config, repeat, actor_fast, target=True, read_s=validate_s)
        kv_share_row(trace, config, repeat, local_fast)
        # untimed runs, counting (local backend: the engine makes the same calls on both)
        calls: Counter[str] = Counter()
        clients: list[KvClient] = []
        count_calls = CountingKv.wrapper(calls)

        def keep(kv: KvClient) -> KvClient:
            clients.append(kv)
            return count_calls(kv)

        counted, _ = run_trace(trace, config, "local", True, keep)
        jumps, jumped = jump_counts(counted)
        del counted
        naming_row(clients, fast_total)
        naming_costs(trace, config.block_size)
        total = fast_total
        print(
            f"  steps simulated {total.steps:,}; taken one at a time {total.steps - jumped:,}, "
            f"the other {jumped:,} in {jumps:,} fast-forward jumps "
            f"({100 * jumped / max(total.steps, 1):.0f}% of steps jumped)"
        )
        print(f"  KV calls (actor round trips), fast-forward: {describe_calls(calls)}")
        print(f"    {calls_per_request(calls, len(trace))}")
        if step_by_step:
            calls = Counter()
            run_trace(trace, config, "local", False, CountingKv.wrapper(calls))
            print(f"  KV calls, step by step: {describe_calls(calls)}")
        print(
            f"  simulated {total.simulated_s:,.0f} s; preemptions {total.preemptions}, "
            f"evictions {total.evictions}, hit rate "
            f"{100 * (total.prefix_cache_hit_rate or 0.0):.1f}%"
        )


def mooncake_section(path: Path, repeat: int, reproduce: str, aic_blocks: int) -> None:
    """Mooncake's synthetic trace, actor backend, fast-forward, two pool sizes; the
    timing models compared at ``aic_blocks``."""
    if not path.is_file():
        print(f"\nMooncake trace: skipped, no file {path}")
        return
    trace, validate_s = read_trace(path)
    with trace:
        print(
            f"\nMooncake trace {path} ({len(trace)} requests; validated in "
            f"{validate_s:.2f} s before the run, not counted below)"
        )
        print(
            "  actor backend, fast-forward, 1 worker, other flags default, uvloop; "
            f"reproduce: {reproduce}"
        )
        print(
            f"  {'--num-gpu-blocks':24s} {'runs':>10s} {'wall time':>11s} {'req/wall s':>10s}"
            "  ms/request"
        )
        with plain_copy(path) as plain:  # for Dynamo's replay, decompressed once
            for blocks in MOONCAKE_BLOCKS:
                config = EngineConfig(num_gpu_blocks=blocks, enable_kv_cache_events=CLI_EVENTS)
                timed = best_of(repeat, functools.partial(run_trace, trace, config, "actor", True))
                total = timed.total
                default = " (default)" if blocks == EngineConfig().num_gpu_blocks else ""
                row(
                    f"{blocks}{default}",
                    timed,
                    f"{1e3 * timed.wall_s / total.requests_submitted:11.2f}   "
                    f"(preemptions {total.preemptions}, hit rate "
                    f"{100 * (total.prefix_cache_hit_rate or 0.0):.1f}%, "
                    f"{total.steps:,} steps)",
                )
                dynamo_row(plain, config, repeat, timed, read_s=validate_s)
                if blocks == MOONCAKE_BLOCKS[-1]:
                    kv_share_row(trace, config, repeat)
                if blocks == aic_blocks:
                    aic_rows(trace, blocks, repeat, timed)


AIC_MODEL = ("Qwen/Qwen3-8B", "h200_sxm")
"""The model and GPU system of the aic rows (the README's example)."""


class TimedTiming:
    """A step-time model wrapped to count its ``duration`` calls and the seconds in them
    (the wrapper's own two clock reads included: about 0.1 us a call)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.seconds = 0.0

    def duration(self, work: Any) -> float:
        start = time.perf_counter()
        value: float = self.inner.duration(work)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return value


class CountedPredictor:
    """aiconfigurator's predictor, counting the queries that reach its database."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.queries = 0

    def predict_prefill_latency(self, bs: int, isl: int, prefix: int = 0) -> float:
        self.queries += 1
        value: float = self.inner.predict_prefill_latency(bs, isl, prefix)
        return value

    def predict_decode_latency(self, bs: int, isl: int, osl: int = 2) -> float:
        self.queries += 1
        value: float = self.inner.predict_decode_latency(bs, isl, osl)
        return value


def aic_rows(trace: MooncakeTrace, blocks: int, repeat: int, linear: Timed) -> None:
    """``--timing-model aic`` (the default context bucket, and exact) against the
    linear run ``linear`` on the same trace and pool."""
    from kvpool.engine.aic import AicSpec, load_predictor
    from kvpool.engine.timing import AIC_CONTEXT_BUCKET, AicTiming

    try:
        start = time.perf_counter()
        predictor, version = load_predictor(AicSpec(*AIC_MODEL))
        compile_s = time.perf_counter() - start
    except ImportError:
        print("  --timing-model aic: skipped (pip install 'kvpool[aic]' to compare)")
        return
    print(
        f"  {blocks} blocks, timing models ({AIC_MODEL[0]} on {AIC_MODEL[1]}, vllm "
        f"{version}, compiled in {compile_s:.2f} s, not counted):"
    )

    def config(timing: Any) -> EngineConfig:
        return EngineConfig(num_gpu_blocks=blocks, enable_kv_cache_events=CLI_EVENTS, timing=timing)

    for label, bucket in (
        ("linear", 0),
        (f"aic, bucket {AIC_CONTEXT_BUCKET}", AIC_CONTEXT_BUCKET),
        ("aic, exact (bucket 1)", 1),
    ):

        def make(source: Any, bucket: int = bucket) -> Any:
            return AicTiming(source, context_bucket=bucket) if bucket else TimingModel()

        # A run with the model timed (and its database queries counted); for the
        # default bucket also plain runs, best of `repeat`, for the wall time (the
        # linear model's is the row above).
        counted = CountedPredictor(predictor)
        wrapped = TimedTiming(make(counted))
        run, wall = run_trace(trace, config(wrapped), "actor", True)
        if bucket == AIC_CONTEXT_BUCKET:
            once = functools.partial(run_trace, trace, config(make(predictor)), "actor", True)
            timed = best_of(repeat, once)
        elif bucket:
            timed = Timed(1, wall, run.report.simulated_s, run.report.total)
        else:
            timed = linear
        del run
        total = timed.total
        queries = f", {counted.queries:,} database queries" if bucket else ""
        row(
            f"  {label}",
            timed,
            f"{1e3 * timed.wall_s / total.requests_submitted:11.2f}   ({total.steps:,} steps, "
            f"TTFT mean {total.ttft_s.mean:.2f} s; in the model "
            f"{1e6 * wrapped.seconds / total.steps:.2f} us a step, "
            f"{1e6 * wrapped.seconds / max(wrapped.calls, 1):.2f} us a call, "
            f"{100 * wrapped.seconds / wall:.1f}% of its timed run{queries})",
        )


@contextmanager
def plain_copy(path: Path) -> Iterator[Path]:
    """``path`` itself, or a decompressed copy of a ``.gz`` (Dynamo's replay reads plain
    JSON lines)."""
    if path.suffix != ".gz":
        yield path
        return
    with tempfile.TemporaryDirectory() as workdir:
        plain = Path(workdir) / path.stem
        with gzip.open(path, "rb") as packed, plain.open("wb") as out:
            shutil.copyfileobj(packed, out)
        yield plain


def embedded_section(args: argparse.Namespace) -> None:
    """The embedded default workload on every backend."""
    requests = default_workload(args.seed)
    print(
        f"embedded default workload: {len(requests)} requests, seed {args.seed}, "
        f"{args.workers} worker(s), default engine flags, uvloop; reproduce: "
        "python benchmarks/bench_engine.py"
    )
    for name, factory in KV_BACKENDS.items():
        best: tuple[float, float, float, SimulationRun] | None = None
        for _ in range(args.repeat):
            run, wall, kv_seconds, turn_seconds = run_once(requests, args.workers, factory)
            if best is None or wall < best[0]:
                best = (wall, kv_seconds, turn_seconds, run)
        assert best is not None
        wall, kv_seconds, turn_seconds, run = best
        total = run.report.total
        assert total.leaked_blocks == 0
        print(f"\n[{name}] best of {args.repeat}")
        print(f"  wall time                {wall:8.2f} s  (target < 15 s)")
        if name == "actor":
            commit, seconds = DIRECT_TURNS_ACTOR
            label = f"{commit}, direct turns"
            print(f"  {label:<25}{seconds:8.2f} s  (same workload, 2026-12-01)")
        print(f"  simulated time           {run.report.simulated_s:8.2f} s")
        print(f"  requests per wall second {total.requests_submitted / wall:8.0f}")
        print(f"  steps per wall second    {total.steps / wall:8.0f}")
        print(
            f"  awaiting KV calls        {100 * kv_seconds / wall:7.1f} % of wall time "
            "(target < 50 %)"
        )
        if turn_seconds:
            print(
                f"  inside pool actor turns  {100 * turn_seconds / wall:7.1f} % of wall time "
                "(the actor's own work: manager + pool; target < 50 %)"
            )
        print(
            f"  preemptions {total.preemptions}, evictions {total.evictions}, "
            f"hit rate {100 * (total.prefix_cache_hit_rate or 0.0):.1f}%"
        )
        if not args.no_profile:
            print("  cProfile, share of profiled time:")
            profile_shares(requests, args.workers, factory)


def main() -> None:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per fast variant (best kept)")
    parser.add_argument("--workers", type=int, default=1, help="engines (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    parser.add_argument(
        "--traces",
        action="store_true",
        help="also run the multi-turn and Mooncake traces (from ../shared unless named)",
    )
    parser.add_argument(
        "--multiturn",
        type=Path,
        metavar="PATH",
        help="the multi-turn trace, already generated (default: generate it with "
        f"{GENERATOR} {' '.join(MULTITURN_ARGS)})",
    )
    parser.add_argument(
        "--mooncake",
        type=Path,
        metavar="PATH",
        help=f"Mooncake's synthetic trace (default: {MOONCAKE})",
    )
    parser.add_argument(
        "--aic-blocks",
        type=int,
        choices=MOONCAKE_BLOCKS,
        default=MOONCAKE_BLOCKS[0],
        help="the Mooncake pool size at which the timing models are compared (default: "
        "%(default)s; at 16384 the decode batches are large, where the database queries "
        "cost most)",
    )
    parser.add_argument(
        "--no-step-by-step",
        action="store_true",
        help="skip the step-by-step runs of the multi-turn trace (about a minute each)",
    )
    parser.add_argument(
        "--no-embedded", action="store_true", help="skip the embedded default workload"
    )
    args = parser.parse_args()

    print(describe_build())
    command = "python benchmarks/bench_engine.py --no-embedded "
    if not args.no_embedded:
        embedded_section(args)
    if args.traces or args.multiturn is not None:
        with tempfile.TemporaryDirectory(prefix="bench_engine_") as workdir:
            path = multiturn_trace(args.multiturn, Path(workdir))
            if path is not None:
                named = "--traces" if args.multiturn is None else f"--multiturn {path}"
                multiturn_section(path, args.repeat, not args.no_step_by_step, command + named)
    if args.traces or args.mooncake is not None:
        named = "--traces" if args.mooncake is None else f"--mooncake {args.mooncake}"
        if args.aic_blocks != MOONCAKE_BLOCKS[0]:
            named += f" --aic-blocks {args.aic_blocks}"
        mooncake_section(args.mooncake or MOONCAKE, args.repeat, command + named, args.aic_blocks)


if __name__ == "__main__":
    main()
