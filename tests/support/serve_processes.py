"""``kvpool serve`` as a child process, for the tests that need the real command."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """A ``kvpool serve`` child process and its base URL."""

    def __init__(self, *flags: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "serve", "--host", "127.0.0.1", *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.process.stderr is not None
        self.log: list[str] = []
        for line in self.process.stderr:  # ends at EOF if the process dies
            self.log.append(line)
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0]
                return
        raise AssertionError(f"kvpool serve did not start: {''.join(self.log)}")

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.process.send_signal(sig)
        _, rest = self.process.communicate(timeout=30)
        return self.process.returncode, "".join(self.log) + rest

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
