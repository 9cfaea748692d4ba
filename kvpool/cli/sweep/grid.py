"""A sweep's grid: axes of ``kvpool simulate`` flag values, and the runs they span.

An axis is a ``kvpool simulate`` flag, named by its long option without the dashes
(``num-gpu-blocks``; an alias or underscores name the same flag), and one or more values
as they would be typed after the flag (``true``/``false`` for a switch such as
``enable-prefix-caching``). A one-value axis fixes the flag for every run. The runs are
the Cartesian product of the axes in the order given, the last axis varying fastest (as
``itertools.product``, Hydra's multirun and Ray Tune's grid search enumerate them).

Axes come from ``--grid KEY=V1,V2,...`` (or ``KEY=range(START,STOP[,STEP])``) or from
a TOML file's ``[grid]`` table (``key = [v1, v2]`` or ``key = v``). Every run's command
line is checked here, as ``kvpool simulate`` checks its own, before anything runs: a bad
spec is a `GridError`.
"""

from __future__ import annotations

import argparse
import io
import itertools
import re
import tomllib
from collections.abc import Iterable, Sequence
from contextlib import redirect_stderr
from dataclasses import dataclass
from pathlib import Path

from kvpool.cli.simulate import check_simulate_flags, simulate_parser
from kvpool.errors import PoolError

# Flags a sweep owns or cannot share between runs in parallel: the outputs (the sweep
# writes its own table) and the KV-event sockets (two runs would bind the same port).
_NOT_SWEPT = {
    "json": "the sweep writes every report: use kvpool sweep --json",
    "plot": "use kvpool sweep --plot",
    "requests-jsonl": "a sweep keeps reports, not per-request records",
    "no-progress": "use kvpool sweep --no-progress",
    "zmq-kv-event-port": "runs in parallel would publish on the same ports",
    "zmq-replay-port": "runs in parallel would bind the same ports",
}
_TRUE, _FALSE = "true", "false"
_ERROR_PREFIX = re.compile(r"^kvpool( simulate)?: error: ")  # argparse's, of either parser


class GridError(ValueError):
    """A grid spec that cannot be run; the message is one line, naming the spec."""


@dataclass(frozen=True, slots=True)
class Axis:
    """One swept flag: its canonical name (the flag's first long option, no dashes) and
    its values, as strings in the order given."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Run:
    """One configuration: its place in the grid, the value of each axis and the
    ``kvpool simulate`` arguments that run it."""

    index: int
    params: dict[str, str]
    argv: tuple[str, ...]

    def label(self, keys: Sequence[str] | None = None) -> str:
        """``key=value ...`` of the axes ``keys`` (default: every axis)."""
        return " ".join(f"{key}={self.params[key]}" for key in keys or self.params)


@dataclass(frozen=True, slots=True)
class Grid:
    """The axes of a sweep and the runs they span, in grid order."""

    axes: tuple[Axis, ...]
    runs: tuple[Run, ...]

    @property
    def swept(self) -> tuple[Axis, ...]:
        """The axes with more than one value."""
        return tuple(axis for axis in self.axes if len(axis.values) > 1)


def parse_grid_flag(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` or ``KEY=range(START,STOP[,STEP])`` (integers, STOP excluded, as
    Python's and Hydra's ``range``) as (key, values); `GridError` if it is neither."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip():
        raise GridError(f"--grid {text!r}: expected KEY=VALUE[,VALUE...] or KEY=range(A,B[,STEP])")
    if values.startswith("range("):
        return key.strip(), _range_values(text, values)
    parts = values.split(",")
    if any(not part for part in parts):
        raise GridError(f"--grid {text!r}: an empty value")
    return key.strip(), parts


_RANGE = re.compile(r"range\((-?\d+),(-?\d+)(?:,(-?\d+))?\)")
_MAX_RANGE = 10_000  # values of one axis: past it a typo, not a sweep


def _range_values(text: str, values: str) -> list[str]:
    match = _RANGE.fullmatch(values.replace(" ", ""))
    if match is None:
        raise GridError(f"--grid {text!r}: expected range(START,STOP[,STEP]) of integers")
    start, stop = int(match[1]), int(match[2])
    step = int(match[3]) if match[3] is not None else 1
    if step == 0:
        raise GridError(f"--grid {text!r}: a range's step cannot be 0")
    numbers = range(start, stop, step)
    if not numbers or len(numbers) > _MAX_RANGE:
        raise GridError(f"--grid {text!r}: {len(numbers)} values (1 to {_MAX_RANGE} expected)")
    return [str(n) for n in numbers]


def read_grid_file(path: str | Path) -> list[tuple[str, list[str]]]:
    """The axes of a TOML sweep file's ``[grid]`` table, in file order.

    ``key = [v1, v2]`` sweeps, ``key = v`` fixes; values are strings, integers, floats or
    booleans. Raises `GridError` for a file that cannot be read or is not of that shape.
    """
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise GridError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"--config: {path} is not TOML: {exc}") from None
    unknown = sorted(set(data) - {"grid"})
    if unknown:
        raise GridError(f"--config: {path}: unknown key {unknown[0]!r} (expected a [grid] table)")
    table = data.get("grid")
    if not isinstance(table, dict) or not table:
        raise GridError(f"--config: {path}: no [grid] table of flags and values")
    axes: list[tuple[str, list[str]]] = []
    for key, raw in table.items():
        values = raw if isinstance(raw, list) else [raw]
        if not values:
            raise GridError(f"--config: {path}: {key} has no value")
        axes.append((key, [_toml_value(path, key, value) for value in values]))
    return axes


def _toml_value(path: str | Path, key: str, value: object) -> str:
    if isinstance(value, bool):  # before int: a bool is an int
        return _TRUE if value else _FALSE
    if isinstance(value, str | int | float):
        return str(value)
    raise GridError(f"--config: {path}: {key}: {value!r} is not a string, number or boolean")


class _FlagTable:
    """The ``kvpool simulate`` flags by every name an axis may use, read from its parser."""

    def __init__(self, simulate: argparse.ArgumentParser) -> None:
        self.actions: dict[str, argparse.Action] = {}
        self.canonical: dict[str, str] = {}
        for action in simulate._actions:  # argparse keeps no public list of its flags
            longs = [o[2:] for o in action.option_strings if o.startswith("--")]
            if isinstance(action, argparse.BooleanOptionalAction):
                longs = [name for name in longs if not name.startswith("no-")]
            if not longs or isinstance(action, argparse._HelpAction):
                continue
            for name in longs:
                self.actions[name] = action
                self.canonical[name] = longs[0]

    def resolve(self, key: str) -> tuple[str, argparse.Action]:
        name = key.removeprefix("--").replace("_", "-")
        if name not in self.actions:
            raise GridError(f"--grid {key}: kvpool simulate has no flag --{name}")
        canonical = self.canonical[name]
        if canonical in _NOT_SWEPT:
            raise GridError(f"--grid {key}: not in a sweep ({_NOT_SWEPT[canonical]})")
        return canonical, self.actions[canonical]


def canonical_flag(key: str) -> str:
    """The axis name of ``kvpool simulate`` flag ``key`` (an alias, underscores or
    leading dashes allowed); ``key`` normalised if there is no such flag."""
    name = key.removeprefix("--").replace("_", "-")
    return _FlagTable(simulate_parser()[1]).canonical.get(name, name)


def _flag_args(key: str, action: argparse.Action, value: str) -> list[str]:
    """The ``kvpool simulate`` arguments that set flag ``key`` to ``value``."""
    if action.nargs == 0:  # a switch: on, off (BooleanOptionalAction) or absent
        if value.lower() not in (_TRUE, _FALSE):
            raise GridError(f"--grid {key}={value}: a switch takes true or false")
        if value.lower() == _TRUE:
            return [f"--{key}"]
        return [f"--no-{key}"] if isinstance(action, argparse.BooleanOptionalAction) else []
    if key == "trace" and value == "-":
        raise GridError("--grid trace=-: a sweep reads each trace per run, not from stdin")
    return [f"--{key}={value}"]  # '=': a value may start with '-'


def check_simulate_args(
    parser: argparse.ArgumentParser, argv: Sequence[str], *, parse_only: bool = False
) -> str | None:
    """Why ``kvpool simulate ARGV`` would be refused before it runs (its one-line
    message), or None: the same parsing and (unless ``parse_only``) flag checks."""
    errors = io.StringIO()
    try:
        with redirect_stderr(errors):  # argparse prints usage and the message, then exits
            args = parser.parse_args(["simulate", *argv])
            if not parse_only:
                check_simulate_flags(args, parser)
    except SystemExit:
        lines = errors.getvalue().strip().splitlines()
        return _ERROR_PREFIX.sub("", lines[-1]) if lines else "refused"
    except (PoolError, ImportError) as exc:
        return str(exc)
    return None


def build_grid(specs: Iterable[tuple[str, Sequence[str]]]) -> Grid:
    """The grid of ``(key, values)`` specs, every run's command line checked.

    Raises `GridError` (one line) for an unknown or unsweepable flag, a flag given
    twice, a repeated value, a value the flag refuses, or a run whose flags contradict
    each other (as ``kvpool simulate`` would refuse them); nothing is run.
    """
    parser, simulate = simulate_parser()
    flags = _FlagTable(simulate)
    axes: list[Axis] = []
    pieces: list[list[list[str]]] = []
    for key, values in specs:
        canonical, action = flags.resolve(key)
        if any(axis.key == canonical for axis in axes):
            raise GridError(f"--grid {canonical}: given twice")
        if len(set(values)) != len(values):
            raise GridError(f"--grid {canonical}: a value is repeated")
        args = [_flag_args(canonical, action, value) for value in values]
        for value, arg in zip(values, args, strict=True):
            # alone, only the value is checked: its flag may need another axis's flag
            problem = check_simulate_args(parser, arg, parse_only=True)
            if problem is not None:
                raise GridError(f"--grid {canonical}={value}: {problem}")
        axes.append(Axis(canonical, tuple(values)))
        pieces.append(args)
    if not axes:
        raise GridError("nothing to sweep: give --grid KEY=V1,V2 or --config FILE")
    runs: list[Run] = []
    for index, combination in enumerate(itertools.product(*(range(len(a.values)) for a in axes))):
        params = {axis.key: axis.values[i] for axis, i in zip(axes, combination, strict=True)}
        argv = tuple(
            arg for axis_args, i in zip(pieces, combination, strict=True) for arg in axis_args[i]
        )
        run = Run(index, params, argv)
        problem = check_simulate_args(parser, argv)
        if problem is not None:
            raise GridError(f"run {index} ({run.label()}): {problem}")
        runs.append(run)
    return Grid(tuple(axes), tuple(runs))
