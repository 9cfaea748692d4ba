"""Each layer imports only the layers above it; the pool core never touches an event loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvpool"

# Top to bottom: a module may import its own layer and the ones before it, never after.
LAYERS = [
    "errors",
    "pool",
    "messages",
    "actors",
    "hashing",
    "events",
    "manager",
    "workloads",
    "engine",
    "cli",
]
ASYNC_MODULES = {"asyncio", "anyio", "trio", "sniffio", "uvloop"}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvpool" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if _layer_of(_dotted(p)) is not None)


def _dotted(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: _dotted(p))
def test_module_imports_only_layers_above_it(path: Path) -> None:
    own = LAYERS.index(_layer_of(_dotted(path)) or "")
    for name in _imports(path):
        layer = _layer_of(name)
        if layer is not None:
            assert LAYERS.index(layer) <= own, f"{_dotted(path)} imports {name} from below"


@pytest.mark.parametrize("path", sorted((PACKAGE / "pool").glob("*.py")), ids=lambda p: _dotted(p))
def test_pool_core_never_imports_an_event_loop(path: Path) -> None:
    for name in _imports(path):
        assert name.split(".")[0] not in ASYNC_MODULES, f"{_dotted(path)} imports {name}"


@pytest.mark.parametrize("module", ["kvpool.pool", "kvpool"])
def test_importing_the_sync_layers_loads_no_event_loop_and_no_actor(module: str) -> None:
    """Checked in a fresh interpreter: what an import loads, not what a file names."""
    probe = (
        f"import sys, {module}\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in "
        f"{sorted(ASYNC_MODULES)!r} or m.startswith('kvpool.actors')]\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "", f"import {module} loaded {result.stdout.strip()}"


def test_the_top_level_namespace_loads_the_async_layers_on_first_use() -> None:
    import kvpool

    assert callable(kvpool.open_pool)
    assert callable(kvpool.open_manager)
    with pytest.raises(AttributeError):
        _ = kvpool.no_such_name  # type: ignore[attr-defined]
