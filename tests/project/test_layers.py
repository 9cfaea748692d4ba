"""Each layer imports only the layers above it, the package has no import cycle, and the
pool core never touches an event loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvpool"

# Top to bottom: a module may import its own layer and the ones before it, never after.
# The flags both commands share (`flags`) sit above `serve`, so serve's handler reads
# them without importing the command line (`cli`: every command, the sweep included).
LAYERS = [
    "lazy",
    "errors",
    "pool",
    "messages",
    "actors",
    "hashing",
    "events",
    "manager",
    "workloads",
    "routing",
    "engine",
    "flags",
    "serve",
    "cli",
]
# The package's own entry points: the top-level namespace and ``python -m kvpool``.
UNLAYERED = {"kvpool", "kvpool.__main__"}
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


def _all_modules() -> dict[str, Path]:
    return {_dotted(path): path for path in sorted(PACKAGE.rglob("*.py"))}


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


def test_every_module_belongs_to_a_layer() -> None:
    """A new top-level package must take its place in `LAYERS`, or nothing checks it."""
    loose = sorted(set(_all_modules()) - UNLAYERED - {_dotted(p) for p in _modules()})
    assert not loose, f"modules in no layer: {loose}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports at run time: every import statement, in a
    function body too (one there runs later, but a cycle through it is a cycle all the
    same: the one between the command line and serve's handler was so), but none under
    ``if TYPE_CHECKING:``. ``from P import N`` imports P, and P.N when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    class Imports(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not _is_type_checking(node.test):
                for child in node.body:
                    self.visit(child)
            for child in node.orelse:
                self.visit(child)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)

    Imports().visit(ast.parse(path.read_text()))
    return {name for name in found if name in known and name != module}


def _import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in import order, the first repeated), or None:
    a depth-first search, a module on the current path met again closing the cycle."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path = [root]
        children = [iter(sorted(graph[root]))]
        while children:
            child = next(children[-1], None)
            if child is None:
                children.pop()
                done.add(path.pop())
            elif child in path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                path.append(child)
                children.append(iter(sorted(graph[child])))
    return None


def _import_graph() -> dict[str, set[str]]:
    modules = _all_modules()
    known = set(modules)
    return {name: _runtime_imports(name, path, known) for name, path in modules.items()}


def test_the_package_has_no_import_cycle() -> None:
    """Between modules, not only between layers: two modules of one layer may not
    import each other either (a lazy import does not make a cycle one)."""
    cycle = _import_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _import_cycle(graph) == ["a", "b", "c", "a"]
    assert _import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_reads_lazy_imports_and_skips_type_checking_ones() -> None:
    graph = _import_graph()
    # kvpool.serve.command imports the shared flags inside run_serve
    assert "kvpool.flags.events" in graph["kvpool.serve.command"]
    assert "kvpool.serve.command" in graph["kvpool.cli.serve"]
    # a TYPE_CHECKING-only import is no edge
    assert "kvpool.manager.client" not in graph["kvpool.manager"]
    assert "kvpool.manager.kv_manager" in graph["kvpool.manager"]


def test_the_one_lazy_loader_serves_both_namespaces() -> None:
    import kvpool.manager
    from kvpool.manager.client import ManagerClient

    assert kvpool.manager.ManagerClient is ManagerClient
    assert kvpool.ManagerClient is ManagerClient
    with pytest.raises(AttributeError, match=r"'kvpool\.manager' has no attribute 'nothing'"):
        _ = kvpool.manager.nothing  # type: ignore[attr-defined]
