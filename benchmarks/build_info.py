"""What a benchmark's figures were measured on: the commit, the machine, its load, and
which kvpool modules run compiled (shared by the benchmark scripts)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def describe_build(*, compiled: bool = True) -> str:
    """One line: commit (``git describe``), Python, cores, load average and, with
    ``compiled``, the kvpool modules loaded from compiled extensions so far."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    line = (
        f"commit {commit}, Python {platform.python_version()}, {os.cpu_count()} cores, "
        f"load average {load}"
    )
    if not compiled:
        return line
    modules = sorted(
        name
        for name, module in sys.modules.items()
        if name.startswith("kvpool.") and (getattr(module, "__file__", None) or "").endswith(".so")
    )
    return f"{line}; compiled{profile_guided()}: {', '.join(modules) or 'nothing (pure Python)'}"


def profile_guided() -> str:
    """`` (profile-guided)`` if the compiled modules loaded so far were built from a
    profile (setup.py records the compiler's flags in the library), else nothing."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.endswith("__mypyc") and path.endswith(".so"):
            return " (profile-guided)" if b"-fprofile-use" in Path(path).read_bytes() else ""
    return ""
