"""Build hook: compile the block-pool core, the request-level KV manager and the engine (its
admission check, scheduler, step bookkeeping, `MockEngine` itself and the loop that drives
it: `EngineLoop`, the simulation's `Arrivals`, dispatch and hooks) with mypyc (2-3x
cheaper pool calls; see benchmarks/README.md for the manager's and the engine's gain),
guided by a profile.

With GCC, the compiled modules are built twice: instrumented, then, once
build_support/pgo_workload.py has run on that build, from the profile it recorded. The
C that mypyc emits is mostly calls, into the interpreter and between its own functions,
and what limits it is the CPU's instruction cache more than the instructions it runs:
laid out by the profile, and with calls between its functions made directly
(`GCC_FLAGS`), a simulation takes 12-23% less time (benchmarks/README.md,
"Profile-guided build"). If any part of that fails (the workload cannot run in the
build environment, say), the modules are built once more without a profile.

Set KVPOOL_PURE_PYTHON=1 to skip compilation; the same modules then run interpreted.
Set KVPOOL_PGO=0 to compile them without a profile (a build in half the time).
All other packaging metadata lives in pyproject.toml.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError

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
    "kvpool/engine/admission.py",
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

ROOT = Path(__file__).resolve().parent
WORKLOAD = ROOT / "build_support" / "pgo_workload.py"
WORKLOAD_TIMEOUT_S = 600
GCC_FLAGS = ["-fno-semantic-interposition"]
"""Added to every build with GCC. mypyc's functions are global symbols of a shared library,
which GCC must assume another library may replace at load time: every call between them
then goes through the PLT and none is inlined. Nothing replaces them (the modules reach
them through a capsule, not the dynamic linker), so calls are made directly."""


class ProfileGuidedBuildExt(build_ext):
    """`build_ext`, building the extensions from a profile of `WORKLOAD` (module
    docstring), or without one if that cannot be done."""

    def run(self) -> None:
        gcc = _gcc()
        if gcc:
            for ext in self.extensions:
                ext.extra_compile_args = [*ext.extra_compile_args, *GCC_FLAGS]
        if not self.extensions or os.environ.get("KVPOOL_PGO", "") == "0" or not gcc:
            super().run()
            return
        plain = [
            (list(ext.extra_compile_args), list(ext.extra_link_args)) for ext in self.extensions
        ]
        self._compiler_option = self.compiler
        with tempfile.TemporaryDirectory(prefix="kvpool-pgo-") as profiles:
            generate = [f"-fprofile-generate={profiles}", "-fprofile-update=single"]
            use = [
                f"-fprofile-use={profiles}",
                "-fprofile-partial-training",  # code the workload missed: as without a profile
                "-fprofile-correction",
                "-Wno-missing-profile",
                "-frecord-gcc-switches",  # says so in the library (benchmarks/build_info.py)
            ]
            try:
                self._build_with(plain, generate, generate)
                self._train(Path(profiles))
                self._build_with(plain, use, [])
                return
            except (
                CCompilerError,
                ExecError,
                OSError,
                subprocess.SubprocessError,
                RuntimeError,
            ) as exc:
                self.warn(f"profile-guided build failed ({exc}); building without a profile")
        self._build_with(plain, [], [])

    def _build_with(
        self,
        plain: list[tuple[list[str], list[str]]],
        compile_args: list[str],
        link_args: list[str],
    ) -> None:
        """Build every extension again, with these flags added to its own."""
        for ext, (compile_plain, link_plain) in zip(self.extensions, plain, strict=True):
            ext.extra_compile_args = compile_plain + compile_args
            ext.extra_link_args = link_plain + link_args
        self.force = True  # the object files of the last build are not this one's
        self.compiler = self._compiler_option  # `run` replaces it by the compiler it made
        super().run()

    def _train(self, profiles: Path) -> None:
        """Run `WORKLOAD` on a copy of the package holding the instrumented build."""
        with tempfile.TemporaryDirectory(prefix="kvpool-train-") as tree:
            shutil.copytree(
                ROOT / "kvpool",
                Path(tree) / "kvpool",
                ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"),
            )
            for ext in self.extensions:
                # a module ``a.b.c`` is built at ``<root>/a/b/c.<suffix>``
                built = Path(self.get_ext_fullpath(ext.name))
                root = built.parents[ext.name.count(".")]
                shutil.copy2(built, Path(tree) / built.relative_to(root))
            env = dict(os.environ, PYTHONPATH=tree)
            subprocess.run(
                [sys.executable, str(WORKLOAD)],
                cwd=tree,
                env=env,
                check=True,
                timeout=WORKLOAD_TIMEOUT_S,
            )
        if not any(profiles.rglob("*.gcda")):
            raise RuntimeError("the workload recorded no profile")


def _gcc() -> bool:
    """Whether the C compiler is GCC (the profile flags above are its own)."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in version and "clang" not in version.lower()


ext_modules = []
if os.environ.get("KVPOOL_PURE_PYTHON", "") in ("", "0"):
    from mypyc.build import mypycify

    # The build environment has only the build requirements: type-check what the core
    # imports, but not the rest of the package (uvloop and the extras are not installed).
    ext_modules = mypycify(["--follow-imports=silent", *CORE], opt_level="3")

setup(ext_modules=ext_modules, cmdclass={"build_ext": ProfileGuidedBuildExt})
