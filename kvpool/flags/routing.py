"""``--dispatch``, ``--router-event-delay-ms`` and ``--router-config``: which router spreads
requests over the workers, and how it is set up (`kvpool.routing`)."""

from __future__ import annotations

import argparse
import json

from kvpool.errors import InvalidArgumentError
from kvpool.routing import DispatchPolicy, RouterSettings, is_router_name, make_router

PLAIN_DISPATCH = ("least-loaded", "round-robin")
"""The dispatch policies that are no router: the engine loop's own."""


def dispatch_name(text: str) -> str:
    """A ``--dispatch`` value: a plain policy, a built-in router or ``module:factory``."""
    if text in PLAIN_DISPATCH or is_router_name(text):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from least-loaded, round-robin, kv, llm-d, "
        "or package.module:factory)"
    )


def router_config(text: str) -> dict[str, object]:
    """A ``--router-config`` value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def delay_ms(text: str) -> float:
    """A ``--router-event-delay-ms`` value: milliseconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_routing_flags(group: argparse._ArgumentGroup) -> None:
    """Add the routing flags to ``group``."""
    group.add_argument(
        "--dispatch",
        type=dispatch_name,
        default="least-loaded",
        metavar="POLICY",
        help="how requests are spread over workers: least-loaded (fewest outstanding "
        "requests, lowest rank on ties), round-robin, kv (Dynamo's KV router), llm-d "
        "(llm-d's default scorers) or package.module:factory (your router; see "
        "kvpool.routing.policy) (default: %(default)s)",
    )
    group.add_argument(
        "--router-event-delay-ms",
        type=delay_ms,
        default=0.0,
        metavar="MS",
        help="a router gets each KV event batch this long after its step ends (default: 0)",
    )
    group.add_argument(
        "--router-config",
        type=router_config,
        default=None,
        metavar="JSON",
        help="the router's settings as a JSON object: for kv, Dynamo's KvRouterConfig "
        'field names (e.g. \'{"overlap_score_weight": 1, "router_temperature": 0}\')',
    )


def check_routing_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse router flags without a router, and a router that cannot be built."""
    if args.dispatch in PLAIN_DISPATCH:
        if args.router_config is not None or args.router_event_delay_ms:
            parser.error("--router-config and --router-event-delay-ms need a router --dispatch")
        return
    try:
        build_router(args, 16)
    except InvalidArgumentError as exc:
        parser.error(str(exc))


def build_router(args: argparse.Namespace, block_size: int) -> DispatchPolicy | None:
    """The router ``args`` name, fresh for one run (None for a plain policy)."""
    if args.dispatch in PLAIN_DISPATCH:
        return None
    settings = RouterSettings(
        num_workers=args.workers,
        block_size=block_size,
        seed=args.seed,
        config=args.router_config or {},
    )
    return make_router(args.dispatch, settings)


def routing_settings_skipped(args: argparse.Namespace) -> set[str]:
    """The routing flags a report's settings leave out: all of them without a router, so
    that a least-loaded or round-robin report reads as it did before routers existed."""
    if args.dispatch in PLAIN_DISPATCH:
        return {"router_event_delay_ms", "router_config"}
    return set()
