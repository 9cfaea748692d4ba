"""The ``kvpool`` program: its parser (one subcommand a module: `kvpool.cli.simulate`,
`kvpool.cli.serve`, `kvpool.cli.profile`, `kvpool.cli.sweep`), `main` and its exit
status (see `kvpool.cli`); SIGTERM unwinds as Ctrl-C does."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType

from kvpool import __version__
from kvpool.cli.profile import add_profile_command
from kvpool.cli.serve import add_serve_command
from kvpool.cli.simulate import add_simulate_command
from kvpool.cli.sweep.command import add_sweep_command


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpool`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvpool", description="kvpool: a model of vLLM's GPU KV-cache block pool."
    )
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_simulate_command(commands)
    add_serve_command(commands)
    add_profile_command(commands)
    add_sweep_command(commands)
    return parser


class _Termination:
    """SIGTERM, turned into the same unwinding as Ctrl-C: the handler notes it and raises
    SIGINT, so whatever handles SIGINT at that moment (Python's default, asyncio's or
    trio's) interrupts cleanly, and `main` tells the two apart by ``received``."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpool`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int] | None = getattr(
        args, "handler", None
    )
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    termination = _Termination()
    previous = signal.signal(signal.SIGTERM, termination)
    # Ctrl-C interrupts however the process was started: a shell's background job (and
    # whatever it starts) inherits SIGINT ignored, and Python then installs no handler
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return handler(args, parser)
    except KeyboardInterrupt:
        return _interrupted(args.command, termination)
    except BaseExceptionGroup as group:  # an interrupt inside a task group
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        return _interrupted(args.command, termination)
    except BrokenPipeError:  # the reader of stdout left (| head): say so, once
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail
        os.close(devnull)
        print(f"kvpool {args.command}: error: stdout was closed early", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


def _interrupted(command: str, termination: _Termination) -> int:
    if termination.received:
        print(f"kvpool {command}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    print(f"kvpool {command}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT
