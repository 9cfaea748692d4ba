"""``kvpool serve``'s handler: flags to a `ServeState`, publishers, then `serve`."""

from __future__ import annotations

import argparse
import sys

from kvpool.errors import PoolError


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
    tokenizer: Tokenizer = BuiltinTokenizer()
    if args.tokenizer is not None:
        try:
            tokenizer = HfTokenizer(args.tokenizer)
        except (ImportError, OSError, ValueError) as exc:
            return fail(f"--tokenizer: {exc}")
    topic = args.zmq_kv_event_topic
    if topic == "llm-d":
        topic = llmd_topic(routable_host(args.host), args.port, args.served_model_name)
    try:
        sinks = open_publishers(args, ranks, topic)
    except Exception as exc:  # zmq.ZMQError (bind), ImportError (no pyzmq), PoolError
        return fail(f"--zmq-kv-event-port: {exc}")
    try:
        state = ServeState(
            config,
            model_name=args.served_model_name,
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


__all__ = ["run_serve"]
