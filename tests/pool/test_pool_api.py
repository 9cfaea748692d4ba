"""The typed facades of the compiled classes (kvpool/pool/_api.pyi for BlockPool,
kvpool/manager/_api.pyi for KvManager) must match their implementations."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvpool.manager
import kvpool.manager.kv_manager
import kvpool.pool
import kvpool.pool.block_pool

POOL_DIR = Path(kvpool.pool.__file__).parent
MANAGER_DIR = Path(kvpool.manager.__file__).parent
# (implementation, stub, class, the class as the package exports it)
FACADES = {
    "BlockPool": (
        POOL_DIR / "block_pool.py",
        POOL_DIR / "_api.pyi",
        "BlockPool",
        kvpool.pool.BlockPool,
    ),
    "KvManager": (
        MANAGER_DIR / "kv_manager.py",
        MANAGER_DIR / "_api.pyi",
        "KvManager",
        kvpool.manager.KvManager,
    ),
}


def _functions(path: Path, class_name: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    (cls,) = [
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name
    ]
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _public_methods(path: Path, class_name: str) -> dict[str, list[str]]:
    return {
        name: [arg.arg for arg in [*node.args.args, *node.args.kwonlyargs]]
        for name, node in _functions(path, class_name).items()
        if not name.startswith("_")
        or (name.startswith("__") and name not in ("__repr__", "__del__"))
    }


@pytest.mark.parametrize("facade", sorted(FACADES))
def test_stub_declares_every_public_method_with_the_same_parameters(facade: str) -> None:
    implementation, stub, class_name, _ = FACADES[facade]
    declared = _public_methods(stub, class_name)
    assert declared == _public_methods(implementation, class_name)


@pytest.mark.parametrize("facade", sorted(FACADES))
def test_stub_declares_the_same_defaults(facade: str) -> None:
    """A default in one but not the other (say admit's ``extra=0``) misleads callers."""
    implementation, stub, class_name, _ = FACADES[facade]
    implemented = _functions(implementation, class_name)
    for name, declared in _functions(stub, class_name).items():
        for kind in ("defaults", "kw_defaults"):
            ours = [ast.unparse(d) for d in getattr(implemented[name].args, kind) if d]
            theirs = [ast.unparse(d) for d in getattr(declared.args, kind) if d]
            assert theirs == ours, f"{name} {kind}"


@pytest.mark.parametrize("facade", sorted(FACADES))
def test_stub_declares_the_same_return_types(facade: str) -> None:
    implementation, stub, class_name, _ = FACADES[facade]
    implemented = _functions(implementation, class_name)
    for name, declared in _functions(stub, class_name).items():
        ours = implemented[name].returns
        theirs = declared.returns
        assert ours is not None, name
        assert theirs is not None, name
        assert ast.unparse(theirs) == ast.unparse(ours), name


def test_admit_is_declared_as_implemented() -> None:
    """admit takes a chain and an optional extra, and may refuse (None)."""
    stub = _functions(POOL_DIR / "_api.pyi", "BlockPool")["admit"]
    assert [arg.arg for arg in stub.args.args] == ["self", "chain", "extra"]
    assert [ast.unparse(d) for d in stub.args.defaults] == ["0"]
    assert stub.returns is not None
    assert ast.unparse(stub.returns) == "Admission | None"


@pytest.mark.parametrize("facade", sorted(FACADES))
def test_runtime_class_has_every_declared_method(facade: str) -> None:
    """The imported class (compiled or not) is built from the current source: a stale
    extension module would lack a newly declared method such as admit."""
    _, stub, class_name, exported = FACADES[facade]
    for name in _public_methods(stub, class_name):
        assert hasattr(exported, name), name


def test_runtime_classes_are_the_implementations() -> None:
    assert kvpool.pool.BlockPool is kvpool.pool.block_pool.BlockPool
    assert kvpool.manager.KvManager is kvpool.manager.kv_manager.KvManager
