"""``kvpool serve``'s command line: its flags (the engine and KV-event flags shared with
``kvpool simulate``, `kvpool.flags`) and its handler, `kvpool.serve.command`, loaded only
when the command runs (it needs the serve extra)."""

from __future__ import annotations

import argparse
import sys

from kvpool.flags.engine import add_engine_flags
from kvpool.flags.events import add_event_flags
from kvpool.flags.values import MAX_PORT, MAX_WORKERS, int_at_least, number_in, speedup


def add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvpool serve`` to ``kvpool``'s subcommands."""
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
        "--port", type=int_at_least(0, MAX_PORT), default=8000, help="(default: %(default)s)"
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
        type=int_at_least(1),
        metavar="BYTES",
        help="largest request body kept; a larger one gets 413, its rest dropped, as a "
        "reverse proxy would refuse it (default: 64 bytes a token of the largest "
        "request, blocks x block size, and at least 1 MiB)",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=int_at_least(0),
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
        type=int_at_least(1, MAX_WORKERS),
        default=1,
        metavar="N",
        help="engines (ranks), each with its own manager actor and event stream at port + "
        "rank; requests go to the rank with the fewest outstanding (default: 1)",
    )
    run.add_argument(
        "--speedup-ratio",
        type=speedup,
        default=1.0,
        metavar="R",
        help="simulated seconds per wall second; 0 = as fast as possible (default: 1)",
    )
    add_event_flags(run)
    faults = serve.add_argument_group("failure injection (router tests)")
    faults.add_argument(
        "--failure-rate",
        type=number_in(0.0, 1.0),
        default=0.0,
        metavar="P",
        help="fail each valid generation request with probability P, seeded (default: 0)",
    )
    faults.add_argument(
        "--fail-first",
        type=int_at_least(0),
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
