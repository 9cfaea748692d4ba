"""The typed facade (kvpool/pool/_api.pyi) must match the compiled implementation."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool.pool
import kvpool.pool.block_pool

POOL_DIR = Path(kvpool.pool.__file__).parent


def _public_methods(path: Path) -> dict[str, list[str]]:
    tree = ast.parse(path.read_text())
    (cls,) = [
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "BlockPool"
    ]
    return {
        node.name: [arg.arg for arg in node.args.args]
        for node in cls.body
        if isinstance(node, ast.FunctionDef)
        and (not node.name.startswith("_") or node.name == "__init__")
    }


def test_stub_declares_every_public_method_with_the_same_parameters() -> None:
    implemented = _public_methods(POOL_DIR / "block_pool.py")
    declared = _public_methods(POOL_DIR / "_api.pyi")
    assert declared == implemented


def test_runtime_blockpool_is_the_implementation() -> None:
    assert kvpool.pool.BlockPool is kvpool.pool.block_pool.BlockPool
