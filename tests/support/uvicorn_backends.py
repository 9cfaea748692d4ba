"""The event loops a test of the HTTP server runs on: asyncio and asyncio with uvloop.

uvicorn is an asyncio server, so trio is not one of them. A server test module takes
them with one line, in place of the suite's three-loop fixture (tests/conftest.py)::

    anyio_backend = uvicorn_backend_fixture()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

UVICORN_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
]


def uvicorn_backend_fixture() -> Callable[..., tuple[str, dict[str, Any]]]:
    """An ``anyio_backend`` fixture over `UVICORN_BACKENDS`."""

    @pytest.fixture(params=UVICORN_BACKENDS)
    def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
        backend: tuple[str, dict[str, Any]] = request.param
        return backend

    return anyio_backend
