"""The typed facade (kvpool/pool/_api.pyi) must match the compiled implementation."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool.pool
import kvpool.pool.block_pool

POOL_DIR = Path(kvpool.pool.__file__).parent


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    (cls,) = [
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "BlockPool"
    ]
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _public_methods(path: Path) -> dict[str, list[str]]:
    return {
        name: [arg.arg for arg in node.args.args]
        for name, node in _functions(path).items()
        if not name.startswith("_") or name == "__init__"
    }


def test_stub_declares_every_public_method_with_the_same_parameters() -> None:
    implemented = _public_methods(POOL_DIR / "block_pool.py")
    declared = _public_methods(POOL_DIR / "_api.pyi")
    assert declared == implemented


def test_stub_declares_the_same_defaults() -> None:
    """A default in one but not the other (say admit's ``extra=0``) misleads callers."""
    implemented = _functions(POOL_DIR / "block_pool.py")
    declared = _functions(POOL_DIR / "_api.pyi")
    for name, stub in declared.items():
        defaults = [ast.unparse(d) for d in implemented[name].args.defaults]
        assert [ast.unparse(d) for d in stub.args.defaults] == defaults, name


def test_admit_is_declared_as_implemented() -> None:
    """admit takes a chain and an optional extra, and may refuse (None)."""
    stub = _functions(POOL_DIR / "_api.pyi")["admit"]
    assert [arg.arg for arg in stub.args.args] == ["self", "chain", "extra"]
    assert [ast.unparse(d) for d in stub.args.defaults] == ["0"]
    assert stub.returns is not None
    assert ast.unparse(stub.returns) == "Admission | None"
    assert "admit" in _public_methods(POOL_DIR / "block_pool.py")


def test_runtime_class_has_every_declared_method() -> None:
    """The imported class (compiled or not) is built from the current source: a stale
    extension module would lack a newly declared method such as admit."""
    for name in _public_methods(POOL_DIR / "_api.pyi"):
        assert hasattr(kvpool.pool.BlockPool, name), name


def test_runtime_blockpool_is_the_implementation() -> None:
    assert kvpool.pool.BlockPool is kvpool.pool.block_pool.BlockPool
