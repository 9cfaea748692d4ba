"""Shared fixtures: every anyio test runs on asyncio, asyncio+uvloop and trio."""

from __future__ import annotations

from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is skipped on platforms it cannot build on
    uvloop = None

_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        ("asyncio", {"loop_factory": uvloop.new_event_loop if uvloop else None}),
        id="uvloop",
        marks=pytest.mark.skipif(uvloop is None, reason="uvloop is not installed here"),
    ),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The anyio plugin's backend: (name, options)."""
    backend: tuple[str, dict[str, Any]] = request.param
    return backend


# The actor and manager tests run with ResourceWarning as an error (an actor must close
# what it opens). A ResourceWarning raised in a __del__ is unraisable: pytest reports it
# as PytestUnraisableExceptionWarning, so that one is an error there too when it carries a
# ResourceWarning (other unraisables, e.g. trio finalizing an async generator an
# interrupt abandoned, stay warnings).
_STRICT_RESOURCES = ("test_actor", "test_manager", "test_engine_actor")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name.startswith(_STRICT_RESOURCES):
            item.add_marker(pytest.mark.filterwarnings("error::ResourceWarning"))
            item.add_marker(
                pytest.mark.filterwarnings(
                    r"error:(?s).*ResourceWarning:pytest.PytestUnraisableExceptionWarning"
                )
            )
