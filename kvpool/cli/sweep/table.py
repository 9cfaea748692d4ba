"""A sweep's table: one row per run, its parameters, status and report figures.

The figures are the report's whole-run ones (``wall_s``, ``requests_per_wall_s``,
``requests_unfinished``, ``requests_unstarted``) and every field of its ``total`` (all
workers), nested ones flattened with dots (``ttft_s.p99``, ``kv_usage.mean``,
``goodput.goodput_completed_requests``): the metrics ``--plot-metric`` takes. The JSON
table keeps each run's whole report as ``kvpool simulate --json`` writes it; the CSV has
the flattened figures.
"""

from __future__ import annotations

import csv
import io
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from kvpool.cli.sweep.execute import Outcome
from kvpool.cli.sweep.grid import Grid
from kvpool.engine.report import Report, WorkerReport

# the report's own figures beside its total's (whose simulated_s is the run's)
_TOP = ("wall_s", "requests_per_wall_s", "requests_unfinished", "requests_unstarted")
_SUMMARY = (  # the text table's figures: (heading, metric, scale, format)
    ("TTFT p99 ms", "ttft_s.p99", 1e3, ".2f"),
    ("E2E p99 ms", "latency_s.p99", 1e3, ".2f"),
    ("hit rate", "prefix_cache_hit_rate", 1.0, ".3f"),
    ("preempt", "preemptions", 1, "d"),
    ("evict", "evictions", 1, "d"),
    ("out tok/s", "output_tokens_per_s", 1.0, ".1f"),
)


def _struct_fields(struct: type[msgspec.Struct], prefix: str) -> Iterator[str]:
    hints = typing.get_type_hints(struct)
    for name in struct.__struct_fields__:
        kind = hints[name]
        if isinstance(kind, types.UnionType):  # X | None: a struct that may be absent
            kind = next(arg for arg in kind.__args__ if arg is not type(None))
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            yield from _struct_fields(kind, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


METRICS: tuple[str, ...] = (
    *(name for name in _TOP if name in Report.__struct_fields__),
    *(name for name in _struct_fields(WorkerReport, "") if name != "worker"),
)
"""Every figure of a run's row, in column order."""


def figures(report: dict[str, Any]) -> dict[str, object]:
    """A decoded report's `METRICS` (None where the report has none: no goodput without
    an SLA, no hit rate without prefix caching)."""
    row: dict[str, object] = {name: report.get(name) for name in _TOP}
    for name in METRICS[len(_TOP) :]:
        value: Any = report["total"]
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        row[name] = value
    return row


class Row(msgspec.Struct, frozen=True):
    """One run in the JSON table: its parameters, whether it passed, why not, its wall
    time and its whole report (None if it did not finish)."""

    run: int
    params: dict[str, str]
    status: str
    error: str | None
    run_wall_s: float
    report: msgspec.Raw | None


def rows(outcomes: Sequence[Outcome]) -> list[Row]:
    """The outcomes as rows, in grid order."""
    return [
        Row(
            run=o.run.index,
            params=o.run.params,
            status="ok" if o.ok else "failed",
            error=o.error,
            run_wall_s=o.wall_s,
            report=None if o.report_json is None else msgspec.Raw(o.report_json),
        )
        for o in sorted(outcomes, key=lambda o: o.run.index)
    ]


def decoded(outcome: Outcome) -> dict[str, Any] | None:
    """The outcome's report as a dict, or None."""
    if outcome.report_json is None:
        return None
    report: dict[str, Any] = msgspec.json.decode(outcome.report_json)
    return report


def table_json(grid: Grid, outcomes: Sequence[Outcome]) -> bytes:
    """``{"grid": {key: [values]}, "runs": [row, ...]}`` as indented JSON."""
    table = {
        "grid": {axis.key: list(axis.values) for axis in grid.axes},
        "runs": rows(outcomes),
    }
    return msgspec.json.format(msgspec.json.encode(table), indent=2) + b"\n"


def table_csv(grid: Grid, outcomes: Sequence[Outcome]) -> str:
    """One line per run, in grid order: ``run``, each axis, ``status``, ``error``,
    ``run_wall_s`` and the `METRICS` (empty where there is none)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = [axis.key for axis in grid.axes]
    writer.writerow(["run", *keys, "status", "error", "run_wall_s", *METRICS])
    for outcome in sorted(outcomes, key=lambda o: o.run.index):
        report = decoded(outcome)
        values = figures(report) if report is not None else {}
        writer.writerow(
            [
                outcome.run.index,
                *(outcome.run.params[key] for key in keys),
                "ok" if outcome.ok else "failed",
                outcome.error or "",
                f"{outcome.wall_s:.3f}",
                *("" if values.get(name) is None else values[name] for name in METRICS),
            ]
        )
    return out.getvalue()


def table_text(grid: Grid, outcomes: Sequence[Outcome]) -> str:
    """An aligned summary for the terminal: the swept axes and a few figures per run."""
    keys = [axis.key for axis in grid.swept] or [axis.key for axis in grid.axes]
    header = ["run", *keys, *(heading for heading, *_ in _SUMMARY), "status"]
    lines = [header]
    for outcome in sorted(outcomes, key=lambda o: o.run.index):
        report = decoded(outcome)
        values = figures(report) if report is not None else {}
        cells = [str(outcome.run.index), *(outcome.run.params[key] for key in keys)]
        for _, metric, scale, spec in _SUMMARY:
            value = values.get(metric)
            cells.append("-" if value is None else format(value * scale, spec))  # type: ignore[operator]
        cells.append("ok" if outcome.ok else f"failed: {outcome.error}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=False))
        + "  "
        + line[-1]
        + "\n"
        for line in lines
    )
