"""Build hook: compile the block-pool core with mypyc (2-3x cheaper pool calls).

Set KVPOOL_PURE_PYTHON=1 to skip compilation; the same modules then run interpreted.
All other packaging metadata lives in pyproject.toml.
"""

import os

from setuptools import setup

CORE = ["kvpool/pool/block_pool.py", "kvpool/pool/copy.py", "kvpool/pool/types.py"]

ext_modules = []
if os.environ.get("KVPOOL_PURE_PYTHON", "") in ("", "0"):
    from mypyc.build import mypycify

    # The build environment has only the build requirements: type-check what the core
    # imports, but not the rest of the package (anyio and friends are not installed).
    ext_modules = mypycify(["--follow-imports=silent", *CORE], opt_level="3")

setup(ext_modules=ext_modules)
