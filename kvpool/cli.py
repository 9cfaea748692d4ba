"""``kvpool``: the command line. ``kvpool simulate`` runs a workload on mock engines;
``kvpool serve`` serves vLLM's OpenAI API over them (`kvpool.serve`, its own extra).
``kvpool sweep`` runs a grid of ``simulate`` configurations (`kvpool.sweep`) through
`simulate_run`.

Exit status: 0 on success, 2 for a bad flag, 1 for bad input (an unreadable or malformed
trace, an output file that cannot be written, a missing optional dependency, a socket
that cannot be bound) or a run that leaked KV blocks, 130 when interrupted (Ctrl-C,
SIGINT) and 143 when terminated (SIGTERM), at any point. Input and output paths are
checked before anything runs. ``kvpool serve`` is the exception once it is listening:
there SIGTERM or SIGINT stops it accepting, lets the requests in flight run for
``--shutdown-timeout`` seconds, aborts the rest and exits 0 (see `kvpool.serve.server`).
Ctrl-C works however the process was started (a SIGINT ignored by inheritance is
restored).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec

from kvpool import __version__
from kvpool.cli_aic import (
    add_aic_flags,
    add_profile_command,
    aic_timing_from_flags,
    check_aic_flags,
)
from kvpool.cli_workload import (
    add_workload_flags,
    check_workload_flags,
    sla,
    synthetic_description,
    synthetic_sessions,
)
from kvpool.engine import EngineConfig, Report, TimingModel, format_report, report_json
from kvpool.engine.progress import ProgressBar
from kvpool.engine.runner import KV_BACKENDS, SimulationRun, run_simulation
from kvpool.engine.timing import (
    Dynamo16ProfileTiming,
    Dynamo16Timing,
    DynamoTiming,
    ProfileTiming,
    StepTiming,
)
from kvpool.errors import PoolError, TraceError
from kvpool.events.codec import EVENT_FORMATS
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

_DEFAULTS = EngineConfig()
_MAX_PORT = 65535
# Flag bounds past which a value is absurd (it would exhaust memory or the clock), so
# it is a usage error rather than a run that hangs or dies.
_MAX_SESSIONS = 100_000  # ~350,000 requests, built up front
_MAX_WORKERS = 10_000  # each holds a pool, a manager and (actor backend) a task
_MAX_POOL_BLOCKS = (1 << 32) - 1  # the pool's own limit
_MAX_TIMING = 1e6  # ms per step, us per token or per sequence: 1,000 s, 1 s, 1 s
_MIN_SPEEDUP = 1e-6
_MAX_SPEEDUP = 1e9
_SUBSCRIBER_GRACE_S = 0.5  # five of a ZMQ subscriber's reconnection intervals
_TIMING = TimingModel()

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


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def _number_at_most(maximum: float) -> Callable[[str], float]:
    """A finite number in ``[0, maximum]``: past the bound a step or a pace is absurd,
    and the simulated clock would stop resolving it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _speedup(text: str) -> float:
    value = _number_at_most(_MAX_SPEEDUP)(text)
    if 0 < value < _MIN_SPEEDUP:
        raise argparse.ArgumentTypeError(f"must be 0 or >= {_MIN_SPEEDUP:g}, got {text}")
    return value


_speedup.__name__ = "number"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags ``kvpool simulate`` and ``kvpool serve`` share (one definition,
    so the two commands take the same engine); `engine_config` reads them back."""
    engine = parser.add_argument_group("engine (per worker)")
    engine.add_argument(
        "--num-gpu-blocks",
        type=_int_at_least(1, _MAX_POOL_BLOCKS),
        default=_DEFAULTS.num_gpu_blocks,
        metavar="N",
        help="KV-cache blocks in each worker's pool (default: %(default)s)",
    )
    engine.add_argument(
        "--block-size",
        type=_int_at_least(1),
        default=_DEFAULTS.block_size,
        metavar="N",
        help="tokens per KV block (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=_int_at_least(1),
        default=_DEFAULTS.max_num_seqs,
        metavar="N",
        help="most requests running at once (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_int_at_least(1),
        default=_DEFAULTS.max_num_batched_tokens,
        metavar="N",
        help="token budget of one step (default: %(default)s)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse cached prompt prefixes (default: on)",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_chunked_prefill,
        help="split long prompts across steps; off: a prompt is computed in one step or "
        "waits (default: on)",
    )
    engine.add_argument(
        "--preemption-mode",
        choices=("lifo", "fifo"),
        default=_DEFAULTS.preemption_mode,
        help="victim when blocks run out: newest running request (lifo, vLLM) or oldest "
        "(fifo) (default: %(default)s)",
    )
    # admission as vLLM 0.33's SchedulerConfig: the whole sequence must fit, and a watermark
    engine.add_argument(
        "--scheduler-reserve-full-isl",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.scheduler_reserve_full_isl,
        help="admit a waiting request only if the blocks of its whole prompt fit, not "
        "only its first chunk's (vLLM's; default: on)",
    )
    engine.add_argument(
        "--watermark",
        type=_number_at_most(1.0),
        default=_DEFAULTS.watermark,
        metavar="FRACTION",
        help="fraction of the pool's blocks an admission must leave free while any "
        "request runs, in [0, 1) (vLLM's; default: %(default)s)",
    )
    engine.add_argument(
        "--step-overhead-ms",
        type=_number_at_most(_MAX_TIMING),
        default=_TIMING.step_overhead_s * 1e3,
        metavar="MS",
        help="timing model: fixed cost of a step (default: %(default)s)",
    )
    engine.add_argument(
        "--prefill-us-per-token",
        type=_number_at_most(_MAX_TIMING),
        default=_TIMING.prefill_token_s * 1e6,
        metavar="US",
        help="timing model: cost per prompt token computed (default: %(default)s)",
    )
    engine.add_argument(
        "--decode-us-per-seq",
        type=_number_at_most(_MAX_TIMING),
        default=_TIMING.decode_seq_s * 1e6,
        metavar="US",
        help="timing model: cost per decoding sequence (default: %(default)s)",
    )
    engine.add_argument(
        "--timing-model",
        choices=("linear", "dynamo", "dynamo-1.6", "aic"),
        default="linear",
        help="step time: linear (the three flags above), dynamo (Dynamo mocker 1.4.0's "
        "default polynomial in the step's prompt tokens and KV usage; dynamo-1.6: as "
        "ai-dynamo-runtime 1.6.1 charges it) or aic (a real "
        "model's latencies on a real GPU, predicted by NVIDIA aiconfigurator's performance "
        "database, as Dynamo's mocker composes them; the --aic-* flags; needs pip install "
        "'kvpool[aic]') (default: %(default)s)",
    )
    engine.add_argument(
        "--planner-profile-data",
        metavar="FILE.npz",
        help="with --timing-model dynamo or dynamo-1.6: interpolate step times from a "
        "Dynamo planner profile (prefill_isl, prefill_ttft_ms, decode_active_kv_tokens, "
        "decode_context_length, decode_itl) instead of the polynomial (needs numpy)",
    )
    add_aic_flags(engine, _int_at_least(1))


def add_event_flags(group: argparse._ArgumentGroup) -> None:
    """The KV-event flags ``kvpool simulate`` and ``kvpool serve`` share."""
    group.add_argument(
        "--zmq-kv-event-port",
        type=_int_at_least(1, _MAX_PORT),
        metavar="PORT",
        help="publish each worker's KV events vLLM-style on a ZMQ PUB socket at "
        "PORT + rank (needs pyzmq); simulate starts its run 0.5 s after binding, so "
        "subscribers started before kvpool see every batch from sequence 0",
    )
    group.add_argument(
        "--zmq-kv-event-host",
        default="*",
        metavar="HOST",
        help="interface the ZMQ publishers bind: an address (IPv4 or IPv6) or a name "
        "(default: all, '*')",
    )
    group.add_argument(
        "--zmq-replay-port",
        type=_int_at_least(1, _MAX_PORT),
        metavar="PORT",
        help="with --zmq-kv-event-port: answer vLLM's replay requests (a DEALER sends an "
        "8-byte big-endian start sequence) on a ZMQ ROUTER at PORT + rank, from the last "
        "--zmq-buffer-steps batches",
    )
    group.add_argument(
        "--zmq-buffer-steps",
        type=_int_at_least(1),
        default=10_000,
        metavar="N",
        help="batches kept for replay (default: %(default)s, vLLM's)",
    )
    group.add_argument(
        "--zmq-kv-event-topic",
        default="",
        metavar="TOPIC",
        help="topic frame of every event message (default: empty, vLLM's); 'llm-d' means "
        "llm-d's kv@<host>:<port>@<model> (serve only: the HTTP host, port and served "
        "model name)",
    )
    group.add_argument(
        "--kv-event-format",
        choices=EVENT_FORMATS,
        default="map",
        help="map: vLLM 0.33.0's events (msgpack maps tagged 'type'); array: the "
        "positional events vLLM sent before its pull request 42892, for routers that "
        "decode only those (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool`` argument parser with its ``simulate`` and ``serve`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvpool", description="kvpool: a model of vLLM's GPU KV-cache block pool."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
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
        "'-' reads standard input; validated whole before the run, then streamed",
    )
    work.add_argument(
        "--trace-block-size",
        type=_int_at_least(1),
        default=MOONCAKE_BLOCK_SIZE,
        metavar="N",
        help="tokens per hash id in the trace (default: %(default)s, Mooncake's)",
    )
    work.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="seed of the embedded default workload (default: %(default)s)",
    )
    work.add_argument(
        "--sessions",
        type=_int_at_least(1, _MAX_SESSIONS),
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
        type=_int_at_least(1, _MAX_WORKERS),
        default=1,
        metavar="N",
        help="engines (data-parallel ranks), each with its own pool and event stream "
        "(default: %(default)s)",
    )
    cluster.add_argument(
        "--dispatch",
        choices=("least-loaded", "round-robin"),
        default="least-loaded",
        help="how requests are spread over workers: fewest outstanding requests (lowest "
        "rank on ties) or in turn (default: %(default)s)",
    )
    cluster.add_argument(
        "--speedup-ratio",
        type=_speedup,
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
        help="where each worker's KV manager and pool run: in its own pool actor task "
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
        "cached_tokens (summed over admissions), preemptions, worker, rejected "
        "('-' = stdout; the text report then goes to stderr)",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway unless stderr is a terminal)",
    )
    sim.set_defaults(handler=_simulate)
    _add_serve(commands)
    add_profile_command(commands, _int_at_least(1))
    from kvpool.sweep.command import add_sweep_command  # imports this module: here, not on top

    add_sweep_command(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API, vLLM's /metrics and KV events over a mock engine",
        description="A drop-in vLLM stand-in: the OpenAI-compatible HTTP API, /metrics "
        "with vLLM's names and vLLM's KV events over ZMQ, answered by the mock engine "
        "over the exact KV-cache model (needs the serve extra: pip install "
        "'kvpool[serve]'). SIGTERM or SIGINT: stop accepting, let the requests in "
        "flight run for --shutdown-timeout seconds, abort the rest, exit 0.",
    )
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    http.add_argument(
        "--port", type=_int_at_least(0, _MAX_PORT), default=8000, help="(default: %(default)s)"
    )
    # vLLM's `vllm serve MODEL` (or --model): the name served unless
    # --served-model-name says otherwise, and the tokenizer when it is a local path
    http.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it: the name served (unless "
        "--served-model-name), and the tokenizer too if it is a local directory "
        "(unless --tokenizer); nothing is ever downloaded",
    )
    http.add_argument("--model", metavar="MODEL", help="the same as MODEL")
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients must send (default: MODEL, else kvpool-mock)",
    )
    http.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local Hugging Face tokenizer: a model directory holding tokenizer.json, "
        "or the file (default: MODEL if it is a local directory, else a built-in "
        "deterministic word tokenizer; nothing is ever downloaded)",
    )
    http.add_argument(
        "--max-request-body-bytes",
        type=_int_at_least(1),
        metavar="BYTES",
        help="largest request body kept; a larger one gets 413, its rest dropped, as a "
        "reverse proxy would refuse it (default: 64 bytes a token of the largest "
        "request, blocks x block size, and at least 1 MiB)",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=_int_at_least(0),
        default=0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long the requests in flight may still run before "
        "they are aborted; a second signal aborts them at once (default: %(default)s, "
        "vLLM's: abort at once)",
    )
    http.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default: %(default)s)",
    )
    add_engine_flags(serve)
    run = serve.add_argument_group("run")
    run.add_argument(
        "--data-parallel-size",
        type=_int_at_least(1, _MAX_WORKERS),
        default=1,
        metavar="N",
        help="engines (ranks), each with its own pool actor and event stream at port + "
        "rank; requests go to the rank with the fewest outstanding (default: 1)",
    )
    run.add_argument(
        "--speedup-ratio",
        type=_speedup,
        default=1.0,
        metavar="R",
        help="simulated seconds per wall second; 0 = as fast as possible (default: 1)",
    )
    add_event_flags(run)
    faults = serve.add_argument_group("failure injection (router tests)")
    faults.add_argument(
        "--failure-rate",
        type=_failure_rate,
        default=0.0,
        metavar="P",
        help="fail each valid generation request with probability P, seeded (default: 0)",
    )
    faults.add_argument(
        "--fail-first",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="fail the first N valid generation requests, the types in turn (default: 0)",
    )
    faults.add_argument(
        "--failure-types",
        type=_failure_types,
        default=None,
        metavar="T[,T...]",
        help="rate_limit (429), overloaded (503), server_error (500), disconnect (the "
        "connection cut mid-response); default: all",
    )
    serve.set_defaults(handler=_serve)


def _failure_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


_failure_rate.__name__ = "number"


def _failure_types(text: str) -> tuple[str, ...]:
    from kvpool.serve.failures import FAILURE_TYPES

    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in FAILURE_TYPES]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"must be among {', '.join(FAILURE_TYPES)}, got {text!r}")
    return kinds


_failure_types.__name__ = "failure types"


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        from kvpool.serve.command import run_serve
    except ImportError as exc:
        print(
            f"kvpool serve: error: it needs its extra: pip install 'kvpool[serve]' ({exc})",
            file=sys.stderr,
        )
        return 1
    return run_serve(args, parser)


class _Termination:
    """SIGTERM, turned into the same unwinding as Ctrl-C: the handler notes it and raises
    SIGINT, so whatever handles SIGINT at that moment (Python's default, asyncio's or
    trio's) interrupts cleanly, and `main` tells the two apart by ``received``."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpool`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int] | None = getattr(
        args, "handler", None
    )
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    termination = _Termination()
    previous = signal.signal(signal.SIGTERM, termination)
    # Ctrl-C interrupts however the process was started: a shell's background job (and
    # whatever it starts) inherits SIGINT ignored, and Python then installs no handler
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return handler(args, parser)
    except KeyboardInterrupt:
        return _interrupted(args.command, termination)
    except BaseExceptionGroup as group:  # an interrupt inside a task group
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        return _interrupted(args.command, termination)
    except BrokenPipeError:  # the reader of stdout left (| head): say so, once
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail
        os.close(devnull)
        print(f"kvpool {args.command}: error: stdout was closed early", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


def _interrupted(command: str, termination: _Termination) -> int:
    if termination.received:
        print(f"kvpool {command}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    print(f"kvpool {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


def _fail(message: str) -> int:
    print(f"kvpool simulate: error: {message}", file=sys.stderr)
    return 1


def _timing(args: argparse.Namespace) -> StepTiming:
    """The step-time model the flags choose (a planner profile is loaded here)."""
    if args.timing_model == "linear":
        return TimingModel(
            step_overhead_s=args.step_overhead_ms / 1e3,
            prefill_token_s=args.prefill_us_per_token / 1e6,
            decode_seq_s=args.decode_us_per_seq / 1e6,
        )
    if args.timing_model == "aic":
        return aic_timing_from_flags(args)
    release_16 = args.timing_model == "dynamo-1.6"
    if args.planner_profile_data is None:
        return Dynamo16Timing() if release_16 else DynamoTiming()
    profile = Dynamo16ProfileTiming if release_16 else ProfileTiming
    return profile.from_npz(args.planner_profile_data)


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The `EngineConfig` the `add_engine_flags` flags describe.

    Exits through ``parser.error`` for flags that contradict each other; raises
    `PoolError` or ``ImportError`` for a planner profile that cannot be loaded.
    """
    if args.planner_profile_data is not None and args.timing_model not in ("dynamo", "dynamo-1.6"):
        parser.error("--planner-profile-data needs --timing-model dynamo")
    check_aic_flags(args, parser)
    timing = _timing(args)
    try:
        return EngineConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            # built only to be published: the report counts the batches either way
            enable_kv_cache_events=args.zmq_kv_event_port is not None,
            preemption_mode=args.preemption_mode,
            scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
            watermark=args.watermark,
            timing=timing,
        )
    except PoolError as exc:
        parser.error(str(exc))


def check_event_flags(
    args: argparse.Namespace, parser: argparse.ArgumentParser, ranks: int
) -> None:
    """Exit through ``parser.error`` if the event flags cannot serve ``ranks`` ranks."""
    for flag in ("zmq_kv_event_port", "zmq_replay_port"):
        port = getattr(args, flag)
        if port is not None and port + ranks - 1 > _MAX_PORT:
            parser.error(
                f"--{flag.replace('_', '-')}: rank {ranks - 1} would use port "
                f"{port + ranks - 1}, above {_MAX_PORT}"
            )
    if args.zmq_replay_port is not None and args.zmq_kv_event_port is None:
        parser.error("--zmq-replay-port needs --zmq-kv-event-port")


def check_simulate_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The `EngineConfig` of a ``kvpool simulate`` command line, after every check of its
    flags that reads no file but a planner profile.

    Exits through ``parser.error`` for flags that contradict each other; raises
    `PoolError` or ``ImportError`` for a planner profile that cannot be loaded.
    """
    config = engine_config(args, parser)
    check_workload_flags(args, parser)
    config = dataclasses.replace(config, max_model_len=args.max_model_len)
    if args.trace and (args.seed != 0 or args.sessions != SyntheticWorkload().num_sessions):
        parser.error("--seed and --sessions shape the embedded workload; --trace replaces it")
    if not args.trace and args.trace_block_size != MOONCAKE_BLOCK_SIZE:
        parser.error("--trace-block-size applies to a --trace only")
    if args.json == "-" and args.requests_jsonl == "-":
        parser.error("--json and --requests-jsonl cannot both write to stdout ('-')")
    check_event_flags(args, parser, args.workers)
    if args.zmq_kv_event_topic == "llm-d":
        parser.error("--zmq-kv-event-topic llm-d names an HTTP endpoint: kvpool serve only")
    return config


def simulate_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SimulationRun:
    """Run what ``kvpool simulate`` runs for ``args`` (parsed by `build_parser`), with no
    output, progress bar or KV-event socket: ``kvpool sweep`` runs each configuration
    through it, so a sweep's reports are the ones ``kvpool simulate`` writes.

    Exits through ``parser.error`` for contradictory flags; raises `PoolError`,
    `TraceError` or ``ImportError`` for input that cannot be used.
    """
    config = check_simulate_flags(args, parser)
    if args.zmq_kv_event_port is not None:
        parser.error("--zmq-kv-event-port: no KV-event sockets in a quiet run")
    backend, options = _backend(args.loop)
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
        backend, options = _backend(args.loop)
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
        try:  # validated whole, streamed later; a TraceWarning is one line on stderr
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
        problem = _unwritable(target)
        if problem is not None:
            return f"{flag}: {problem}"
        if args.trace and args.trace != "-" and _same_file(target, args.trace):
            return f"{flag}: {target} is the trace; writing it would destroy the input"
        key = os.path.realpath(target)
        if key in taken:
            return f"{flag}: {target} is also the {taken[key]} file"
        taken[key] = flag
    return None


def _unwritable(target: str) -> str | None:
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


def open_publishers(
    args: argparse.Namespace, ranks: int, topic: str
) -> list[ZmqEventPublisher] | None:
    """One `ZmqEventPublisher` per rank as the `add_event_flags` flags say (rank r at
    port + r, its replay ROUTER at replay port + r), or None without
    ``--zmq-kv-event-port``. Raises ``ImportError`` without pyzmq, ``zmq.ZMQError`` if a
    port cannot be bound (nothing is left open then)."""
    if args.zmq_kv_event_port is None:
        return None
    from kvpool.events import ZmqEventPublisher

    endpoint = zmq_endpoint(args.zmq_kv_event_host, args.zmq_kv_event_port)
    replay = (
        None
        if args.zmq_replay_port is None
        else zmq_endpoint(args.zmq_kv_event_host, args.zmq_replay_port)
    )
    sinks: list[ZmqEventPublisher] = []
    try:
        # rank r publishes on PORT + r, as vLLM does; one by one, to close them on failure
        for rank in range(ranks):
            publisher = ZmqEventPublisher(
                data_parallel_rank=rank,
                endpoint=endpoint,
                replay_endpoint=replay,
                buffer_steps=args.zmq_buffer_steps,
                topic=topic,
                bind=True,
                event_format=args.kv_event_format,
            )
            sinks.append(publisher)
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def zmq_endpoint(host: str, port: int) -> str:
    """The tcp endpoint of ``--zmq-kv-event-host``/``-port``; an IPv6 address is bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


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
            dispatch=args.dispatch,
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


def _backend(loop: str) -> tuple[str, dict[str, object]]:
    """anyio's backend name and options for ``--loop``; ImportError if it is missing."""
    if loop == "trio":
        try:
            import trio  # noqa: F401
        except ImportError as exc:
            raise ImportError("--loop trio: trio is not installed: pip install trio") from exc
        return "trio", {}
    if loop == "asyncio":
        return "asyncio", {}
    try:
        import uvloop  # noqa: F401
    except ImportError as exc:
        if loop == "uvloop":
            raise ImportError("--loop uvloop: uvloop is not installed: pip install uvloop") from exc
        return "asyncio", {}
    return "asyncio", {"use_uvloop": True}


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
    for record in records:
        yield encoder.encode(record) + b"\n"


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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
