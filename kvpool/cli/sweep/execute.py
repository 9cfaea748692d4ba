"""Running a sweep's configurations: one at a time in this process, in a pool of
processes (one per core by default), or as tasks on a Ray cluster.

Each configuration runs through `kvpool.cli.simulate.simulate_run`, the code ``kvpool
simulate`` runs, so its report is the one ``kvpool simulate`` would write for the same flags (its
wall-clock figures aside). A configuration that fails (bad input, an exception, a
leaked block, a worker process that died) is an `Outcome` with an error, never the end
of the sweep.
"""

from __future__ import annotations

import concurrent.futures as futures
import io
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import Any

from kvpool.cli.sweep.grid import Run

LOCAL_RAY = "local"
"""``--ray local``: start a Ray instance on this machine for the sweep."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run gave: its report as ``kvpool simulate --json`` writes it (None if it
    did not finish), the error that failed it (None if it passed) and its wall time."""

    run: Run
    report_json: bytes | None
    error: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


def run_configuration(argv: Sequence[str]) -> tuple[bytes | None, str | None]:
    """Run ``kvpool simulate ARGV`` in this process: (its JSON report, None) or, when it
    failed, (the report if it has one, the one-line error). Never raises an exception
    (but an interrupt)."""
    from kvpool.cli.simulate import simulate_parser, simulate_run
    from kvpool.engine import report_json

    parser, _ = simulate_parser()
    errors = io.StringIO()
    try:
        # stdout: a run prints nothing of its own, but a library warning must not land
        # in the table a sweep may write there
        with redirect_stderr(errors), redirect_stdout(io.StringIO()):
            run = simulate_run(parser.parse_args(["simulate", *argv]), parser)
    except SystemExit:  # parser.error: the grid checked the flags, so only in a race
        lines = errors.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "refused its flags"
    except Exception as exc:  # the run's failure is the table's to report
        if _caused_by_interrupt(exc):  # Ctrl-C (inline) that an actor turned into a crash
            raise KeyboardInterrupt from exc
        return None, f"{type(exc).__name__}: {exc}"
    report = run.report
    leaked = report.total.leaked_blocks
    error = f"{leaked} KV blocks were still active after every request finished"
    return report_json(report), error if leaked else None


def _caused_by_interrupt(exc: BaseException) -> bool:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return True
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        stack.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return False


def _timed(argv: Sequence[str]) -> tuple[bytes | None, str | None, float]:
    start = time.perf_counter()
    report, error = run_configuration(argv)
    return report, error, time.perf_counter() - start


def _start_worker() -> None:
    """A worker process's start: Ctrl-C reaches the whole process group, and the sweep
    (not each worker) decides what it stops; the imports are paid here, so that a run's
    wall time is the run's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import kvpool.cli.simulate  # noqa: F401


def default_jobs() -> int:
    """One process per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def run_inline(runs: Sequence[Run]) -> Iterator[Outcome]:
    """Each run in this process, one after another, in grid order."""
    for run in runs:
        report, error, wall = _timed(run.argv)
        yield Outcome(run, report, error, wall)


Task = Callable[[Sequence[str]], tuple[bytes | None, str | None, float]]
"""Runs one configuration's arguments: (report, error, wall seconds)."""


def run_in_processes(runs: Sequence[Run], jobs: int, task: Task | None = None) -> Iterator[Outcome]:
    """The runs on ``jobs`` worker processes (spawned: a fresh interpreter, as ``kvpool
    simulate`` starts in), as they finish.

    At most ``jobs`` runs are in flight, so when a worker process dies (killed, out of
    memory) the suspects are known: each is run again alone in a fresh process and fails
    only if that process dies too; the other runs go on in a fresh pool. ``task`` (a
    module-level function, default `run_configuration` timed) runs each.
    """
    context = multiprocessing.get_context("spawn")
    pending = list(runs)
    pending.reverse()  # pop() from the end: grid order
    while pending:
        suspects = yield from _pool_until_broken(pending, jobs, context, task or _timed)
        for run in suspects:
            yield from _run_alone(run, context, task or _timed)


def _new_pool(jobs: int, context: Any) -> futures.ProcessPoolExecutor:
    return futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker)


def _pool_until_broken(
    pending: list[Run], jobs: int, context: Any, task: Task
) -> Generator[Outcome, None, list[Run]]:
    """Run ``pending`` (popped from the end) on a pool of ``jobs`` processes; if the pool
    breaks, return the runs that were in flight then (the rest stay pending)."""
    pool = _new_pool(jobs, context)
    flight: dict[futures.Future[tuple[bytes | None, str | None, float]], Run] = {}
    suspects: list[Run] = []
    try:
        while (pending or flight) and not suspects:
            while pending and len(flight) < jobs:
                run = pending.pop()
                flight[pool.submit(task, run.argv)] = run
            done, _ = futures.wait(flight, return_when=futures.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: flight[f].index):
                run = flight.pop(future)
                try:
                    report, error, wall = future.result()
                except futures.process.BrokenProcessPool:
                    suspects.append(run)
                else:
                    yield Outcome(run, report, error, wall)
        return sorted([*suspects, *flight.values()], key=lambda r: r.index)
    finally:
        _stop(pool)


def _run_alone(run: Run, context: Any, task: Task) -> Iterator[Outcome]:
    pool = _new_pool(1, context)
    start = time.perf_counter()
    try:
        report, error, wall = pool.submit(task, run.argv).result()
    except futures.process.BrokenProcessPool:
        wall = time.perf_counter() - start
        yield Outcome(run, None, "its worker process died (killed, or out of memory?)", wall)
        return
    finally:
        _stop(pool)
    yield Outcome(run, report, error, wall)


def _stop(pool: futures.ProcessPoolExecutor) -> None:
    """Shut ``pool`` down now, its workers terminated: on an interrupt they must not
    finish their runs first (they ignore SIGINT)."""
    processes = list(getattr(pool, "_processes", {}).values())  # no public handle in 3.11
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join()


class ClusterError(RuntimeError):
    """Ray could not be started or joined (before any run started)."""


def require_ray() -> Any:
    """The ``ray`` module, or `ImportError` with the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "--ray needs ray, which is not installed: pip install 'kvpool[ray]'"
        ) from exc
    return ray


def run_on_ray(
    runs: Sequence[Run], address: str, jobs: int | None, on_start: Callable[[str], None]
) -> Iterator[Outcome]:
    """The runs as Ray tasks (one CPU each) on the cluster at ``address`` (`LOCAL_RAY`:
    a Ray started here with ``jobs`` CPUs), as they finish; ``on_start`` is told where.

    Every node must import the same kvpool and read each trace at the same path.
    """
    ray = require_ray()
    try:
        if address == LOCAL_RAY:
            ray.init(num_cpus=jobs, include_dashboard=False, logging_level="ERROR")
        else:
            ray.init(address=address, logging_level="ERROR")
    except Exception as exc:  # ConnectionError, or Ray's own for a cluster it cannot join
        raise ClusterError(f"--ray {address}: cannot start or join Ray: {exc}") from exc
    try:
        on_start(f"Ray {ray.__version__}, {int(ray.cluster_resources().get('CPU', 0))} CPUs")
        task = ray.remote(num_cpus=1, max_retries=0)(_timed)
        flight = {task.remote(list(run.argv)): run for run in runs}
        while flight:
            done, _ = ray.wait(list(flight), num_returns=1)
            for ref in done:
                run = flight.pop(ref)
                try:
                    report, error, wall = ray.get(ref)
                except Exception as exc:  # a worker that died, a node lost: the run failed
                    yield Outcome(run, None, f"Ray: {type(exc).__name__}: {exc}", 0.0)
                else:
                    yield Outcome(run, report, error, wall)
    finally:
        ray.shutdown()
