"""``--plot``: KV usage and prefix-cache hit rate over simulated time, one line per worker.

matplotlib is optional (``pip install 'kvpool[plot]'``); it is imported only here, and
only when a plot is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from kvpool.engine.engine import MockEngine
from kvpool.engine.metrics import EngineStats

_MAX_POINTS = 4000  # per line: a plot need not draw every step


def require_matplotlib() -> None:
    """Raise `ImportError` with an install hint unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'kvpool[plot]'"
        ) from exc


def check_plot_format(path: str | Path) -> None:
    """Raise `ValueError` naming the choices unless matplotlib can draw the format that
    ``path``'s extension names (no extension: PNG). Needs matplotlib."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(
            f"--plot: cannot draw a .{suffix} file; use one of: {', '.join(sorted(formats))}"
        )


def plot_series(
    stats: EngineStats, max_points: int = _MAX_POINTS
) -> tuple[list[float], list[float], list[float]]:
    """An engine's per-step samples, thinned to about ``max_points``: simulated times,
    KV usage (%) and cumulative hit rate (%, NaN before the first query: undefined, not 0).

    The last sample is always kept: it is the idle cache after the last request (0%).
    """
    count = len(stats.sample_times)
    stride = max(1, count // max_points)
    picked = list(range(0, count, stride))
    if picked and picked[-1] != count - 1:
        picked.append(count - 1)
    times = [stats.sample_times[i] for i in picked]
    usage = [100 * stats.usage[i] for i in picked]
    rates = [
        100 * stats.hit_samples[i] / stats.query_samples[i] if stats.query_samples[i] else math.nan
        for i in picked
    ]
    return times, usage, rates


def write_plot(engines: Sequence[MockEngine], path: str | Path) -> None:
    """Draw each engine's KV usage and cumulative hit rate against simulated time to ``path``.

    The image format follows the file's extension (PNG without one). Raises `ImportError`
    without matplotlib and `OSError` if the file cannot be written.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 6), layout="constrained")
    usage_axes, hit_axes = figure.subplots(2, 1, sharex=True)
    for engine in engines:
        times, usage, rates = plot_series(engine.stats)
        label = f"worker {engine.rank}"
        usage_axes.plot(times, usage, linewidth=0.8, label=label, drawstyle="steps-post")
        hit_axes.plot(times, rates, linewidth=1.2, label=label)
    usage_axes.set_ylabel("KV usage (%)")
    usage_axes.set_ylim(0, 105)
    usage_axes.set_title("KV cache usage after each step")
    hit_axes.set_ylabel("prefix-cache hit rate (%)")
    hit_axes.set_ylim(0, 105)
    hit_axes.set_xlabel("simulated time (s)")
    hit_axes.set_title("cumulative prefix-cache hit rate (tokens)")
    if len(engines) > 1:
        usage_axes.legend(loc="upper right")
    # the format is named, so the file is exactly ``path`` (matplotlib would add ".png")
    figure.savefig(path, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
