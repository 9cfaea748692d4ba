"""The one lazy module loader: a package's ``__getattr__`` (PEP 562) that imports the
module holding a name on first use, so importing the package stays light (``import
kvpool`` loads no event loop, ``import kvpool.manager`` no actor)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each lazy name to the
    module it is imported from; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
