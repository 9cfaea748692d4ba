"""The type the engine takes for its cache: `kvpool.manager.ManagerClient`.

The engine talks to its cache only through that one client (its contract, and what each
transport does to a call: `kvpool.manager.client`), inline (`LocalKvClient`, what
``--kv-backend local`` uses), through the manager actor (`open_manager`), or timed
(`TimedKvClient`).
"""

from __future__ import annotations

from typing import TypeAlias

from kvpool.manager.client import LocalKvClient, ManagerClient, TimedKvClient

KvClient: TypeAlias = ManagerClient
"""The engine's KV client."""

__all__ = ["KvClient", "LocalKvClient", "TimedKvClient"]
