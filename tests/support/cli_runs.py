"""``python -m kvpool`` in a subprocess, as a user runs it: `kvpool` and the repository
root `ROOT` it runs in. Shared by the command-line and routing tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def kvpool(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvpool ARGS`` with this interpreter; capture text output."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
        **kwargs,
    )
