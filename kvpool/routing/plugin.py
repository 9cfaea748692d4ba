"""``--dispatch``: a built-in router by name, or a user's as ``package.module:factory``.

A factory is called with one `RouterSettings` and returns a `DispatchPolicy`
(`kvpool.routing.policy` states the contract). It may set ``uses_kv_events = False`` on
what it returns when it never reads them, so that the engines need not build them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from kvpool.errors import InvalidArgumentError
from kvpool.routing.kv import KvRouter
from kvpool.routing.llmd import LlmdRouter
from kvpool.routing.policy import DispatchPolicy, RouterSettings

RouterFactory = Callable[[RouterSettings], DispatchPolicy]
BUILT_IN: dict[str, RouterFactory] = {"kv": KvRouter, "llm-d": LlmdRouter}
"""The built-in routers by ``--dispatch`` name."""


def is_router_name(name: str) -> bool:
    """Whether ``name`` names a router (built-in or ``module:factory``)."""
    return name in BUILT_IN or ":" in name


def load_factory(name: str) -> RouterFactory:
    """The factory ``name`` names. Raises `InvalidArgumentError` when it cannot be loaded."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise InvalidArgumentError(
            f"--dispatch {name!r}: expected kv, llm-d or package.module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"--dispatch {name!r}: cannot import {module_name}: {exc}"
        ) from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise InvalidArgumentError(
            f"--dispatch {name!r}: {module_name} has no callable {attribute}"
        )
    return cast(RouterFactory, factory)


def make_router(name: str, settings: RouterSettings) -> DispatchPolicy:
    """The router ``name`` names, built for ``settings``; it must have the protocol's
    three methods (`InvalidArgumentError` otherwise)."""
    policy = load_factory(name)(settings)
    methods = ("choose", "observe", "finished")
    missing = [m for m in methods if not callable(getattr(policy, m, None))]
    if missing:
        raise InvalidArgumentError(f"--dispatch {name!r}: the router has no {', '.join(missing)}")
    return policy
