"""``kvpool simulate``: run a workload on mock engines and report what the KV cache did.

`add_simulate_command` adds its flags (the engine and KV-event flags from `kvpool.flags`,
the workload flags from `kvpool.cli.workload`); `simulate_run` runs a configuration with
no output, for ``kvpool sweep``. Input and output paths are checked before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvpool.cli.workload import (
    add_workload_flags,
    check_workload_flags,
    sla,
    synthetic_description,
    synthetic_sessions,
)
from kvpool.engine import EngineConfig, Report, format_report, report_json
from kvpool.engine.clock import event_loop
from kvpool.engine.progress import ProgressBar
from kvpool.engine.runner import KV_BACKENDS, SimulationRun, run_simulation
from kvpool.errors import PoolError, TraceError
from kvpool.flags.engine import add_engine_flags, engine_config
from kvpool.flags.events import add_event_flags, check_event_flags, open_publishers
from kvpool.flags.routing import (
    PLAIN_DISPATCH,
    add_routing_flags,
    build_router,
    check_routing_flags,
    routing_settings_skipped,
)
from kvpool.flags.values import MAX_WORKERS, int_at_least, speedup
from kvpool.workloads import (
    MOONCAKE_BLOCK_SIZE,
    MooncakeTrace,
    RequestSpec,
    Session,
    SyntheticWorkload,
    TraceWarning,
)

if TYPE_CHECKING:
    from kvpool.events import EventSink, ZmqEventPublisher

_MAX_SESSIONS = 100_000  # ~350,000 requests, built up front
_SUBSCRIBER_GRACE_S = 0.5  # five of a ZMQ subscriber's reconnection intervals

_DESCRIPTION = """\
Run a serving workload through vLLM v1-style mock engines over the modelled KV-cache
block pool, and report what the cache did: hit rate, usage, preemptions, evictions.

Without --trace it runs the embedded default workload: a seeded mix of multi-turn chat
sessions on shared system prompts, sized so that with the default flags the cache fills
up, blocks are evicted and requests are preempted, in a few seconds of wall time.
"""

_EPILOG = """\
timing model: each engine step takes (linear, the default)
  step-overhead + prefill-per-token * prefill tokens + decode-per-seq * decoding sequences
or (dynamo) 4.209989e-7*T^2 + 1.518344e-2*T + 16.50142 ms if it computes T prompt tokens,
plus max(1, -25.74*p^2 + 54.01*p + 5.74) ms if it samples a token, p = KV usage,
or (aic) aiconfigurator's predicted prefill pass plus decode pass for --aic-model,
of simulated time; --speedup-ratio 0 (the default) runs as fast as possible, a ratio R > 0
paces the run so simulated time passes R times faster than wall time.

exit status: 0 done, 1 bad input (trace, output path) or a leaked block, 2 bad flags,
130 interrupted, 143 terminated (SIGTERM).

examples:
  kvpool simulate
  kvpool simulate --workers 2 --json report.json --plot usage.png
  kvpool simulate --trace kvpool/data/sample_trace.jsonl --num-gpu-blocks 2048
  zcat trace.jsonl.gz | kvpool simulate --trace - --requests-jsonl requests.jsonl
"""


def add_simulate_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``kvpool simulate`` to ``kvpool``'s subcommands; its parser."""
    sim = commands.add_parser(
        "simulate",
        help="run a workload on mock engines and report KV-cache behaviour",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    work = sim.add_argument_group("workload")
    work.add_argument(
        "--trace",
        metavar="FILE",
        help="Mooncake trace (JSON lines: timestamp ms, input_length, output_length, "
        "hash_ids) to replay instead of the embedded default workload; gzip is read, "
        "'-' reads standard input; read and validated whole before the run",
    )
    work.add_argument(
        "--trace-block-size",
        type=int_at_least(1),
        default=MOONCAKE_BLOCK_SIZE,
        metavar="N",
        help="tokens per hash id in the trace (default: %(default)s, Mooncake's)",
    )
    work.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="seed of the embedded default workload (default: %(default)s)",
    )
    work.add_argument(
        "--sessions",
        type=int_at_least(1, _MAX_SESSIONS),
        default=SyntheticWorkload().num_sessions,
        metavar="N",
        help="chat sessions in the embedded default workload (default: %(default)s)",
    )

    add_engine_flags(sim)

    cluster = sim.add_argument_group("run")
    cluster.add_argument(
        "--workers",
        "--data-parallel-size",
        dest="workers",
        type=int_at_least(1, MAX_WORKERS),
        default=1,
        metavar="N",
        help="engines (data-parallel ranks), each with its own pool and event stream "
        "(default: %(default)s)",
    )
    add_routing_flags(cluster)
    cluster.add_argument(
        "--speedup-ratio",
        type=speedup,
        default=0.0,
        metavar="R",
        help="simulated seconds per wall second; 0 = as fast as possible (default: 0)",
    )
    cluster.add_argument(
        "--fast-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="jump over the steps in which running requests only decode (no arrival, "
        "finish, preemption or admission) in closed form, the blocks they add or fill in "
        "one KV call; the results are identical to stepping one step at a time "
        "(--no-fast-forward) (default: on)",
    )
    add_event_flags(cluster)
    add_workload_flags(sim)
    cluster.add_argument(
        "--kv-backend",
        choices=("actor", "local"),
        default="actor",
        help="where each worker's KV manager and pool run: in its own manager actor task "
        "(actor) or called inline by the engine (local, faster); the simulation is the "
        "same (default: %(default)s)",
    )
    cluster.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio", "trio"),
        default="auto",
        help="event loop: uvloop when installed (auto), or force one (default: auto)",
    )

    out = sim.add_argument_group("output")
    out.add_argument(
        "--json",
        metavar="FILE",
        help="also write the report as JSON to FILE ('-' = stdout; the text report then "
        "goes to stderr)",
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw KV usage and prefix-cache hit rate over simulated time (needs matplotlib)",
    )
    out.add_argument(
        "--requests-jsonl",
        metavar="FILE",
        help="also write one JSON line per request, by arrival: arrival_s, "
        "first_scheduled_s, first_token_s, finish_s, prompt_tokens, output_tokens, "
        "cached_tokens (summed over admissions), preemptions, worker, rejected, and with "
        "a router router_overlap_blocks (the prompt blocks it saw cached on that worker) "
        "('-' = stdout; the text report then goes to stderr)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway unless stderr is a terminal)",
    )
    sim.set_defaults(handler=_simulate)
    return sim


def simulate_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """A ``kvpool`` parser with only the ``simulate`` command, and that command's parser:
    ``kvpool sweep`` checks and runs its configurations with it (the same flags, messages
    and settings as ``kvpool simulate``'s)."""
    parser = argparse.ArgumentParser(prog="kvpool")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser, add_simulate_command(commands)


def _fail(message: str) -> int:
    print(f"kvpool simulate: error: {message}", file=sys.stderr)
    return 1


def check_simulate_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The `EngineConfig` of a ``kvpool simulate`` command line, after every check of its
    flags that reads no file but a planner profile.

    Exits through ``parser.error`` for flags that contradict each other; raises
    `PoolError` or ``ImportError`` for a planner profile that cannot be loaded.
    """
    config = engine_config(args, parser)
    check_workload_flags(args, parser)
    config = dataclasses.replace(config, max_model_len=args.max_model_len)
    routed = args.dispatch not in PLAIN_DISPATCH  # --seed then seeds the router too
    if args.trace and (
        (args.seed != 0 and not routed) or args.sessions != SyntheticWorkload().num_sessions
    ):
        parser.error("--seed and --sessions shape the embedded workload; --trace replaces it")
    check_routing_flags(args, parser)
    if not args.trace and args.trace_block_size != MOONCAKE_BLOCK_SIZE:
        parser.error("--trace-block-size applies to a --trace only")
    if args.json == "-" and args.requests_jsonl == "-":
        parser.error("--json and --requests-jsonl cannot both write to stdout ('-')")
    check_event_flags(args, parser, args.workers)
    if args.zmq_kv_event_topic == "llm-d":
        parser.error("--zmq-kv-event-topic llm-d names an HTTP endpoint: kvpool serve only")
    return config


def simulate_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SimulationRun:
    """Run what ``kvpool simulate`` runs for ``args`` (parsed by `simulate_parser` or
    `kvpool.cli.build_parser`), with no output, progress bar or KV-event socket:
    ``kvpool sweep`` runs each configuration through it, so a sweep's reports are the
    ones ``kvpool simulate`` writes.

    Exits through ``parser.error`` for contradictory flags; raises `PoolError`,
    `TraceError` or ``ImportError`` for input that cannot be used.
    """
    config = check_simulate_flags(args, parser)
    if args.zmq_kv_event_port is not None:
        parser.error("--zmq-kv-event-port: no KV-event sockets in a quiet run")
    backend, options = event_loop(args.loop)
    trace = (
        MooncakeTrace(args.trace, trace_block_size=args.trace_block_size) if args.trace else None
    )
    try:
        requests, workload = _workload(args, trace)
        return _run(args, backend, options, config, requests, workload, None, None)
    finally:
        if trace is not None:
            trace.close()


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = check_simulate_flags(args, parser)
    except (PoolError, ImportError) as exc:
        return _fail(str(exc))
    # Everything that can fail on input fails here, before the run starts.
    failure = _check_outputs(args)
    if failure is not None:
        return _fail(failure)
    try:
        backend, options = event_loop(args.loop)
    except ImportError as exc:
        return _fail(str(exc))
    if args.plot:
        from kvpool.engine.plot import check_plot_format, require_matplotlib

        try:
            require_matplotlib()
            check_plot_format(args.plot)
        except (ImportError, ValueError) as exc:
            return _fail(str(exc))
    trace: MooncakeTrace | None = None
    if args.trace:
        if args.trace == "-" and sys.stdin.isatty():  # a forgotten pipe would look hung
            print("kvpool simulate: reading the trace from stdin (Ctrl-D ends it)", file=sys.stderr)
        try:  # read and validated whole; a TraceWarning is one line on stderr
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TraceWarning)
                trace = MooncakeTrace(args.trace, trace_block_size=args.trace_block_size)
        except TraceError as exc:
            return _fail(str(exc))
        for warning in caught:
            print(f"kvpool simulate: warning: {warning.message}", file=sys.stderr)
    try:
        requests, workload = _workload(args, trace)
        return _simulate_loaded(args, backend, options, config, requests, workload)
    finally:
        if trace is not None:
            trace.close()


def _workload(
    args: argparse.Namespace, trace: MooncakeTrace | None
) -> tuple[Iterable[RequestSpec | Session], str]:
    if trace is not None:
        order = "" if trace.in_order else ", out of timestamp order: held and sorted"
        return trace, f"trace {trace.source} ({len(trace)} requests{order})"
    if args.synthetic:
        synthetic = synthetic_sessions(args)
        sessions = synthetic.sessions()
        count = sum(session.num_turns for session in sessions)
        return sessions, synthetic_description(synthetic, count)
    requests = SyntheticWorkload(seed=args.seed, num_sessions=args.sessions).requests()
    return requests, (
        f"embedded default workload (seed {args.seed}, {args.sessions} sessions, "
        f"{len(requests)} requests)"
    )


_OUTPUTS = (("--json", "json"), ("--plot", "plot"), ("--requests-jsonl", "requests_jsonl"))


def _check_outputs(args: argparse.Namespace) -> str | None:
    """Why an output path cannot be written (or would destroy the trace or another
    output), or None; a file that did not exist is left not existing."""
    taken: dict[str, str] = {}
    for flag, name in _OUTPUTS:
        target = getattr(args, name)
        if not target or target == "-":
            continue
        problem = unwritable(target)
        if problem is not None:
            return f"{flag}: {problem}"
        if args.trace and args.trace != "-" and _same_file(target, args.trace):
            return f"{flag}: {target} is the trace; writing it would destroy the input"
        key = os.path.realpath(target)
        if key in taken:
            return f"{flag}: {target} is also the {taken[key]} file"
        taken[key] = flag
    return None


def unwritable(target: str) -> str | None:
    """Why ``target`` cannot be written (a directory, no such directory, refused), or
    None; a file that did not exist is left not existing. ``kvpool sweep`` checks its
    outputs with it too."""
    path = Path(target)
    if path.is_dir():
        return f"{target} is a directory"
    if not path.parent.is_dir():
        return f"no such directory: {path.parent}"
    existed = path.exists()
    try:  # non-blocking: a FIFO with no reader fails instead of hanging
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        return f"cannot write {target}: {exc.strerror or exc}"
    os.close(fd)
    if not existed:
        path.unlink(missing_ok=True)
    return None


def _same_file(first: str, second: str) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(first) == os.path.realpath(second)


def _simulate_loaded(
    args: argparse.Namespace,
    backend: str,
    options: dict[str, object],
    config: EngineConfig,
    requests: Iterable[RequestSpec | Session],
    workload: str,
) -> int:
    try:
        sinks = _open_sinks(args)
    except Exception as exc:  # zmq.ZMQError (bind), ImportError (no pyzmq), PoolError
        return _fail(f"--zmq-kv-event-port: {exc}")
    progress: ProgressBar | None = None
    try:
        if sinks:
            _await_subscribers(sinks)
        progress = ProgressBar(sys.stderr) if _show_progress(args) else None
        run = _run(args, backend, options, config, requests, workload, sinks, progress)
    finally:  # an interrupt too: end the progress line, close the sockets
        if progress is not None:
            progress.close()
        for sink in sinks or ():
            sink.close()
    failure = _write_outputs(args, run)
    if failure is not None:
        return _fail(failure)
    leaked = run.report.total.leaked_blocks
    if leaked:
        return _fail(f"{leaked} KV blocks were still active after every request finished")
    return 0


def _open_sinks(args: argparse.Namespace) -> list[ZmqEventPublisher] | None:
    return open_publishers(args, args.workers, args.zmq_kv_event_topic)


def _await_subscribers(publishers: Sequence[ZmqEventPublisher]) -> None:
    """Say where events go, then give subscribers that are already dialling time to join.

    A SUB socket started before kvpool retries its connection every 100 ms (ZMQ's
    default) and a PUB socket drops what it sends before a subscription arrives; a run
    at full speed publishes hundreds of batches in that time, so without this pause a
    router would miss the first ones (a child before its parent, a Removed of a hash it
    never saw) and the stream would not start at sequence 0.
    """
    where = ", ".join(f"{p.endpoint} (worker {p.data_parallel_rank})" for p in publishers)
    print(f"kvpool simulate: publishing KV events on {where}", file=sys.stderr)
    time.sleep(_SUBSCRIBER_GRACE_S)


def _show_progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _settings(args: argparse.Namespace) -> dict[str, object]:
    skip = {"command", "handler", "json", "plot", "requests_jsonl", "no_progress"}
    skip |= routing_settings_skipped(args)
    return {key: value for key, value in sorted(vars(args).items()) if key not in skip}


def _run(
    args: argparse.Namespace,
    backend: str,
    options: dict[str, object],
    config: EngineConfig,
    requests: Iterable[RequestSpec | Session],
    workload: str,
    sinks: Sequence[EventSink] | None,
    progress: ProgressBar | None,
) -> SimulationRun:
    import anyio

    async def go() -> SimulationRun:
        return await run_simulation(
            requests,
            config,
            workers=args.workers,
            dispatch=build_router(args, config.block_size) or args.dispatch,
            router_event_delay_s=args.router_event_delay_ms / 1e3,
            router_name=args.dispatch,
            speedup_ratio=args.speedup_ratio,
            fast_forward=args.fast_forward,
            sinks=sinks,
            on_progress=progress,
            workload=workload,
            settings=_settings(args),
            kv_factory=KV_BACKENDS[args.kv_backend],
            concurrency=args.concurrency,
            arrival_speedup_ratio=args.arrival_speedup_ratio,
            max_sim_time_s=args.max_sim_time_s,
            lockstep=args.data_parallel_lockstep,
            sla=sla(args),
        )

    return anyio.run(go, backend=backend, backend_options=options)


def _write_outputs(args: argparse.Namespace, run: SimulationRun) -> str | None:
    """Print the report and write the files asked for; the first failure's message, or
    None. The text report is printed first, so a file that cannot be written loses
    nothing else; it goes to stderr when a file is written to stdout ('-')."""
    report: Report = run.report
    text = format_report(report)
    if "-" in (args.json, args.requests_jsonl):
        sys.stderr.write(text)
        sys.stderr.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    if args.json:
        failure = _write("--json", args.json, [report_json(report)])
        if failure is not None:
            return failure
    if args.requests_jsonl:
        failure = _write("--requests-jsonl", args.requests_jsonl, _request_lines(run))
        if failure is not None:
            return failure
    if args.plot:
        from kvpool.engine.plot import write_plot

        try:
            write_plot(run.engines, args.plot)
        except OSError as exc:
            return f"--plot: cannot write {args.plot}: {exc.strerror or exc}"
    return None


def _request_lines(run: SimulationRun) -> Iterable[bytes]:
    """One JSON line per request of the run, by arrival (then worker, then settling)."""
    records = [record for engine in run.engines for record in engine.stats.requests]
    records.sort(key=lambda record: (record.arrival_s, record.worker))
    encoder = msgspec.json.Encoder()
    router = run.router
    for record in records:
        line = encoder.encode(record)
        if router is not None:  # routed: the overlap (blocks) its router saw, or null
            overlap = router.overlap_seen(record.request_id)
            line = line[:-1] + b',"router_overlap_blocks":' + encoder.encode(overlap) + b"}"
        yield line + b"\n"


def _write(flag: str, target: str, chunks: Iterable[bytes]) -> str | None:
    """Write ``chunks`` to ``target`` ('-' = stdout); the failure's message, or None."""
    if target == "-":
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        return None
    try:
        with open(target, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
    except OSError as exc:
        return f"{flag}: cannot write {target}: {exc.strerror or exc}"
    return None
