"""The KV-event flags ``kvpool simulate`` and ``kvpool serve`` share, and the ZMQ
publishers they open: one per data-parallel rank, as vLLM's."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvpool.events.codec import EVENT_FORMATS
from kvpool.flags.values import MAX_PORT, int_at_least

if TYPE_CHECKING:
    from kvpool.events import ZmqEventPublisher


def add_event_flags(group: argparse._ArgumentGroup) -> None:
    """The KV-event flags ``kvpool simulate`` and ``kvpool serve`` share."""
    group.add_argument(
        "--zmq-kv-event-port",
        type=int_at_least(1, MAX_PORT),
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
        type=int_at_least(1, MAX_PORT),
        metavar="PORT",
        help="with --zmq-kv-event-port: answer vLLM's replay requests (a DEALER sends an "
        "8-byte big-endian start sequence) on a ZMQ ROUTER at PORT + rank, from the last "
        "--zmq-buffer-steps batches",
    )
    group.add_argument(
        "--zmq-buffer-steps",
        type=int_at_least(1),
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


def check_event_flags(
    args: argparse.Namespace, parser: argparse.ArgumentParser, ranks: int
) -> None:
    """Exit through ``parser.error`` if the event flags cannot serve ``ranks`` ranks."""
    for flag in ("zmq_kv_event_port", "zmq_replay_port"):
        port = getattr(args, flag)
        if port is not None and port + ranks - 1 > MAX_PORT:
            parser.error(
                f"--{flag.replace('_', '-')}: rank {ranks - 1} would use port "
                f"{port + ranks - 1}, above {MAX_PORT}"
            )
    if args.zmq_replay_port is not None and args.zmq_kv_event_port is None:
        parser.error("--zmq-replay-port needs --zmq-kv-event-port")


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
