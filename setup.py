"""Build hook: compile the block-pool core, the request-level KV manager and the engine (its
scheduler, step bookkeeping, `MockEngine` itself and the loop that drives it: `EngineLoop`,
the simulation's `Arrivals`, dispatch and hooks) with mypyc (2-3x cheaper pool calls; see
benchmarks/README.md for the manager's and the engine's gain).

Set KVPOOL_PURE_PYTHON=1 to skip compilation; the same modules then run interpreted.
All other packaging metadata lives in pyproject.toml.
"""

import os

from setuptools import setup

CORE = [
    "kvpool/pool/block_pool.py",
    "kvpool/pool/extent.py",
    "kvpool/pool/types.py",
    "kvpool/pool/runs.py",
    "kvpool/hashing/block_hash.py",
    "kvpool/hashing/hasher.py",
    "kvpool/hashing/run_keys.py",
    "kvpool/engine/metrics.py",
    "kvpool/engine/request.py",
    "kvpool/engine/scheduler.py",
    "kvpool/engine/work.py",
    "kvpool/engine/fast_forward.py",
    "kvpool/engine/execution.py",
    "kvpool/engine/engine.py",
    "kvpool/engine/arrivals.py",
    "kvpool/engine/dispatch.py",
    "kvpool/engine/loop.py",
    "kvpool/engine/simulation.py",
    "kvpool/manager/admission.py",
    "kvpool/manager/kv_manager.py",
    "kvpool/manager/request.py",
    "kvpool/manager/run_slots.py",
    "kvpool/manager/validation.py",
    "kvpool/workloads/tokens.py",
    "kvpool/workloads/trace_rows.py",
]

ext_modules = []
if os.environ.get("KVPOOL_PURE_PYTHON", "") in ("", "0"):
    from mypyc.build import mypycify

    # The build environment has only the build requirements: type-check what the core
    # imports, but not the rest of the package (anyio and friends are not installed).
    ext_modules = mypycify(["--follow-imports=silent", *CORE], opt_level="3")

setup(ext_modules=ext_modules)
