"""``kvpool serve``'s handler: flags to a `ServeState`, publishers, then `serve`."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from kvpool.errors import PoolError


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What MODEL, --model, --served-model-name and --tokenizer add up to."""

    served_name: str
    tokenizer: str | None
    """A local tokenizer path, or None for the built-in tokenizer."""
    tokenizer_source: str
    """The flag the tokenizer came from (for its error message)."""


def resolve_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServedModel:
    """vLLM's rules: the served name is --served-model-name, else the model; the
    tokenizer is --tokenizer, else the model when it is a local path (vLLM loads the
    tokenizer from the model; a hub name would need a download, so the built-in
    tokenizer stands in; a name written as a path must exist). Exits through
    ``parser.error`` if MODEL and --model differ."""
    from kvpool.serve.state import DEFAULT_MODEL_NAME

    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} differ")
    model: str | None = args.model_tag or args.model
    served = args.served_model_name or model or DEFAULT_MODEL_NAME
    if args.tokenizer is not None:
        return ServedModel(served, args.tokenizer, "--tokenizer")
    # a path that does not exist is a typo, not a hub name: its load fails, one line
    if model is not None and (os.path.exists(model) or model.startswith((".", "/", "~"))):
        return ServedModel(served, os.path.expanduser(model), "MODEL")
    return ServedModel(served, None, "")


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Validate the flags, open the event publishers, serve until a signal.

    Exit status: 0 after a clean shutdown, 2 for a bad flag, 1 for bad input (a
    tokenizer or profile that cannot be loaded, a port that cannot be bound) or a
    leaked KV block.
    """
    from kvpool.events.zmq_publisher import llmd_topic
    from kvpool.flags.engine import engine_config
    from kvpool.flags.events import check_event_flags, open_publishers
    from kvpool.serve.failures import FAILURE_TYPES, FailureInjector
    from kvpool.serve.intake import RequestLimits
    from kvpool.serve.server import routable_host, serve
    from kvpool.serve.state import ServeState
    from kvpool.serve.tokenizer import BuiltinTokenizer, HfTokenizer, Tokenizer

    def fail(message: str) -> int:
        print(f"kvpool serve: error: {message}", file=sys.stderr)
        return 1

    try:
        config = engine_config(args, parser)
    except (PoolError, ImportError) as exc:
        return fail(str(exc))
    ranks = args.data_parallel_size
    check_event_flags(args, parser, ranks)
    model = resolve_model(args, parser)
    tokenizer: Tokenizer = BuiltinTokenizer()
    if model.tokenizer is not None:
        try:
            tokenizer = HfTokenizer(model.tokenizer)
        except (ImportError, OSError, ValueError) as exc:
            return fail(f"{model.tokenizer_source}: {exc}")
    topic = args.zmq_kv_event_topic
    if topic == "llm-d":
        topic = llmd_topic(routable_host(args.host), args.port, model.served_name)
    try:
        sinks = open_publishers(args, ranks, topic)
    except Exception as exc:  # zmq.ZMQError (bind), ImportError (no pyzmq), PoolError
        return fail(f"--zmq-kv-event-port: {exc}")
    try:
        state = ServeState(
            config,
            model_name=model.served_name,
            data_parallel_size=ranks,
            speedup_ratio=args.speedup_ratio,
            tokenizer=tokenizer,
            sinks=sinks,
            failures=FailureInjector(
                args.failure_rate,
                args.failure_types or FAILURE_TYPES,
                fail_first=args.fail_first,
            ),
            limits=RequestLimits(args.max_request_body_bytes),
        )
        if sinks:
            where = ", ".join(f"{s.endpoint} (rank {s.data_parallel_rank})" for s in sinks)
            print(f"kvpool serve: publishing KV events on {where}", file=sys.stderr)
        return serve(
            state,
            args.host,
            args.port,
            log_level=args.log_level,
            shutdown_timeout=args.shutdown_timeout,
        )
    finally:
        for sink in sinks or ():
            sink.close()


__all__ = ["ServedModel", "resolve_model", "run_serve"]
