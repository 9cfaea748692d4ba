"""``kvpool simulate``'s flags for the workloads Dynamo's replay runs, named as its
``python -m dynamo.replay`` names them: the synthetic generator, closed-loop load,
arrival speedup, a stopped clock, max-model-len, goodput SLAs and lockstep ranks.

`add_workload_flags` defines them, `check_workload_flags` refuses contradictions
(through ``parser.error``: one line, nothing run), `synthetic_sessions` builds the
synthetic workload and `sla` the goodput targets.
"""

from __future__ import annotations

import argparse

from kvpool.engine.goodput import Sla
from kvpool.flags.values import int_in, number_in
from kvpool.workloads import MAX_TRACE_TOKENS, SyntheticSessions, SyntheticWorkload

_MAX_REQUESTS = 1_000_000  # synthetic requests are built up front
_MAX_CONCURRENCY = 1_000_000
_MAX_SECONDS = 1e9  # the latest timestamp a trace may hold, in seconds
_MAX_RATIO = 1e9
_SYNTHETIC_FLAGS = (
    ("input_tokens", None),
    ("output_tokens", None),
    ("request_count", None),
    ("request_rate", None),
    ("arrival_interval_ms", None),
    ("turns_per_session", 1),
    ("shared_prefix_ratio", 0.0),
    ("num_prefix_groups", 0),
    ("inter_turn_delay_ms", 0.0),
)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The synthetic-workload, load, SLA and lockstep flags of ``kvpool simulate``."""
    synthetic = parser.add_argument_group(
        "synthetic workload (Dynamo replay's: --synthetic with --input-tokens, "
        "--output-tokens, --request-count and one of --request-rate, "
        "--arrival-interval-ms, --concurrency)"
    )
    synthetic.add_argument(
        "--synthetic",
        action="store_true",
        help="run Dynamo replay's synthetic workload (seeded by --seed) instead of the "
        "embedded default",
    )
    tokens = int_in(1, MAX_TRACE_TOKENS)
    synthetic.add_argument("--input-tokens", type=tokens, metavar="N", help="prompt tokens")
    synthetic.add_argument("--output-tokens", type=tokens, metavar="N", help="output tokens")
    synthetic.add_argument(
        "--request-count",
        type=int_in(1, _MAX_REQUESTS),
        metavar="N",
        help="sessions (each --turns-per-session requests), as Dynamo counts them",
    )
    synthetic.add_argument(
        "--request-rate",
        type=number_in(0.0, _MAX_RATIO, low_open=True),
        metavar="R",
        help="sessions per second, a Poisson process from time 0",
    )
    synthetic.add_argument(
        "--arrival-interval-ms",
        type=number_in(0.0, _MAX_SECONDS * 1e3),
        metavar="MS",
        help="a session every MS milliseconds from time 0",
    )
    synthetic.add_argument(
        "--turns-per-session",
        type=int_in(1, _MAX_REQUESTS),
        default=1,
        metavar="N",
        help="requests per session, each sent --inter-turn-delay-ms after the previous "
        "one finished (default: %(default)s)",
    )
    synthetic.add_argument(
        "--inter-turn-delay-ms",
        type=number_in(0.0, _MAX_SECONDS * 1e3),
        default=0.0,
        metavar="MS",
        help="delay between a turn's end and the next turn (default: 0)",
    )
    synthetic.add_argument(
        "--shared-prefix-ratio",
        type=number_in(0.0, 1.0),
        default=0.0,
        metavar="F",
        help="fraction of each prompt that is its prefix group's shared prefix, rounded "
        "up to whole KV blocks (default: 0)",
    )
    synthetic.add_argument(
        "--num-prefix-groups",
        type=int_in(0, _MAX_REQUESTS),
        default=0,
        metavar="N",
        help="shared prefixes; each session picks one at random (default: 0)",
    )

    load = parser.add_argument_group("load (as Dynamo's replay)")
    load.add_argument(
        "--concurrency",
        "--replay-concurrency",
        dest="concurrency",
        type=int_in(1, _MAX_CONCURRENCY),
        metavar="N",
        help="closed loop: N sessions in flight, the next sent the moment one ends; the "
        "trace's timestamps then only order it (default: open loop, by timestamp)",
    )
    load.add_argument(
        "--arrival-speedup-ratio",
        type=number_in(0.0, _MAX_RATIO, low_open=True),
        default=1.0,
        metavar="R",
        help="divide every arrival time by R (open loop; default: 1)",
    )
    load.add_argument(
        "--max-sim-time-s",
        type=number_in(0.0, _MAX_SECONDS, low_open=True),
        metavar="S",
        help="stop the simulated clock at S: nothing is sent and no step starts from S "
        "on; the report counts the requests unfinished (aborted) and unstarted",
    )
    load.add_argument(
        "--max-model-len",
        type=int_in(1, MAX_TRACE_TOKENS * 2),
        metavar="N",
        help="reject a request of more than N tokens, prompt plus output, as vLLM does "
        "(counted as rejected) (default: no limit but the pool)",
    )
    load.add_argument(
        "--data-parallel-lockstep",
        action="store_true",
        help="the --workers are data-parallel ranks of one model stepping together "
        "(vLLM MoE DP, Dynamo's dp_size): every step lasts as long as the slowest rank's "
        "(steps one at a time); default: independent workers",
    )
    for name, what in (
        ("ttft", "time to first token"),
        ("itl", "mean inter-token latency"),
        ("e2e", "end-to-end latency"),
    ):
        load.add_argument(
            f"--sla-{name}-ms",
            type=number_in(0.0, _MAX_SECONDS * 1e3, low_open=True),
            metavar="MS",
            help=f"goodput: a request is good if its {what} is <= MS (with the other "
            "--sla flags: all must hold)",
        )


def check_workload_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit through ``parser.error`` if the `add_workload_flags` flags contradict each
    other or the workload flags."""
    if args.synthetic:
        if args.trace:
            parser.error("--synthetic and --trace are two workloads: choose one")
        if args.sessions != SyntheticWorkload().num_sessions:
            parser.error("--sessions shapes the embedded workload; --synthetic has --request-count")
        missing = [
            f"--{name.replace('_', '-')}"
            for name in ("input_tokens", "output_tokens", "request_count")
            if getattr(args, name) is None
        ]
        if missing:
            parser.error(f"--synthetic needs {', '.join(missing)}")
        pacing = [args.request_rate, args.arrival_interval_ms, args.concurrency]
        if sum(value is not None for value in pacing) != 1:
            parser.error(
                "--synthetic needs exactly one of --request-rate, --arrival-interval-ms, "
                "--concurrency (as Dynamo's replay)"
            )
        if (args.shared_prefix_ratio > 0) != (args.num_prefix_groups > 0):
            parser.error("--shared-prefix-ratio and --num-prefix-groups need each other")
        if args.inter_turn_delay_ms and args.turns_per_session == 1:
            parser.error("--inter-turn-delay-ms needs --turns-per-session of 2 or more")
        if args.request_count * args.turns_per_session > _MAX_REQUESTS:
            parser.error(f"--request-count x --turns-per-session must be <= {_MAX_REQUESTS}")
    else:
        given = [
            f"--{name.replace('_', '-')}"
            for name, default in _SYNTHETIC_FLAGS
            if getattr(args, name) != default
        ]
        if given:
            parser.error(f"{given[0]} shapes the --synthetic workload; add --synthetic")
    if args.concurrency is not None and args.arrival_speedup_ratio != 1.0:
        parser.error("--arrival-speedup-ratio scales timestamps; --concurrency reads none")


def synthetic_sessions(args: argparse.Namespace) -> SyntheticSessions:
    """The `SyntheticSessions` the ``--synthetic`` flags describe (checked already)."""
    return SyntheticSessions(
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        request_count=args.request_count,
        request_rate=args.request_rate,
        arrival_interval_s=None
        if args.arrival_interval_ms is None
        else args.arrival_interval_ms / 1e3,
        turns_per_session=args.turns_per_session,
        shared_prefix_ratio=args.shared_prefix_ratio,
        num_prefix_groups=args.num_prefix_groups,
        inter_turn_delay_s=args.inter_turn_delay_ms / 1e3,
        block_size=args.block_size,
        seed=args.seed,
    )


def synthetic_description(workload: SyntheticSessions, requests: int) -> str:
    """The report's one-line name of the synthetic workload."""
    if workload.request_rate is not None:
        pace = f"{workload.request_rate:g} sessions/s"
    elif workload.arrival_interval_s is not None:
        pace = f"one session every {1e3 * workload.arrival_interval_s:g} ms"
    else:
        pace = "closed loop"
    prefix = (
        f", {workload.num_prefix_groups} prefix groups of {workload.prefix_tokens} tokens"
        if workload.num_prefix_groups
        else ""
    )
    return (
        f"synthetic workload (seed {workload.seed}, {workload.request_count} sessions x "
        f"{workload.turns_per_session} turns = {requests} requests, "
        f"{workload.input_tokens} in / {workload.output_tokens} out tokens, {pace}{prefix})"
    )


def sla(args: argparse.Namespace) -> Sla | None:
    """The goodput targets the ``--sla-*`` flags set, or None."""
    targets = (args.sla_ttft_ms, args.sla_itl_ms, args.sla_e2e_ms)
    if all(target is None for target in targets):
        return None
    return Sla(ttft_ms=targets[0], itl_ms=targets[1], e2e_ms=targets[2])
