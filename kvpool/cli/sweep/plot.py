"""``kvpool sweep --plot``: chosen metrics against one swept parameter, one line per
combination of the other swept parameters (TTFT p99 against ``num-gpu-blocks``, a line
per ``dispatch`` policy). A failed run is a gap in its line.

matplotlib is optional (the ``plot`` extra), imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from kvpool.cli.sweep.execute import Outcome
from kvpool.cli.sweep.grid import Grid
from kvpool.cli.sweep.table import decoded, figures


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def plot_lines(
    grid: Grid, outcomes: Sequence[Outcome], x: str, metric: str
) -> tuple[list[float], list[str], dict[str, list[float]]]:
    """The x positions, their tick labels and each line's y values (NaN: no figure) of
    ``metric`` against axis ``x``. Numeric values of ``x`` are placed at their value,
    others at 0, 1, 2, ... in grid order; lines are labelled ``key=value ...`` by the
    other swept axes (``metric`` alone if there is none)."""
    axis = next(a for a in grid.axes if a.key == x)
    numbers = [_number(value) for value in axis.values]
    positions = (
        [n for n in numbers if n is not None]
        if all(n is not None for n in numbers)
        else [float(i) for i in range(len(axis.values))]
    )
    where = dict(zip(axis.values, range(len(axis.values)), strict=True))
    others = [a.key for a in grid.swept if a.key != x]
    lines: dict[str, list[float]] = {}
    for outcome in sorted(outcomes, key=lambda o: o.run.index):
        params = outcome.run.params
        label = " ".join(f"{key}={params[key]}" for key in others) or metric
        ys = lines.setdefault(label, [math.nan] * len(axis.values))
        report = decoded(outcome) if outcome.ok else None
        value = None if report is None else figures(report)[metric]
        if isinstance(value, int | float):
            ys[where[params[x]]] = float(value)
    return positions, list(axis.values), lines


def write_sweep_plot(
    grid: Grid, outcomes: Sequence[Outcome], x: str, metrics: Sequence[str], path: str | Path
) -> None:
    """Draw each of ``metrics`` (a panel each) against swept axis ``x`` to ``path`` (the
    format by its extension, PNG without one). Raises `ImportError` without matplotlib
    and `OSError` if the file cannot be written."""
    from kvpool.engine.plot import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.2 * len(metrics) + 0.6), layout="constrained")
    panels = figure.subplots(len(metrics), 1, sharex=True, squeeze=False)[:, 0]
    for panel, metric in zip(panels, metrics, strict=True):
        positions, ticks, lines = plot_lines(grid, outcomes, x, metric)
        for label, ys in lines.items():
            panel.plot(positions, ys, marker="o", linewidth=1.2, label=label)
        panel.set_ylabel(metric)
        panel.grid(visible=True, alpha=0.3)
        if len(lines) > 1:
            panel.legend(fontsize="small")
        panel.set_xticks(positions, ticks)
    panels[-1].set_xlabel(x)
    panels[0].set_title(f"kvpool sweep: {len(outcomes)} runs")
    figure.savefig(path, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
