"""``--plot``: KV usage and prefix-cache hit rate over simulated time, one line per worker.

matplotlib is optional (``pip install 'kvpool[plot]'``); it is imported only here, and
only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpool.engine.engine import MockEngine

_MAX_POINTS = 4000  # per line: a plot need not draw every step


def require_matplotlib() -> None:
    """Raise `ImportError` with an install hint unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'kvpool[plot]'"
        ) from exc


def write_plot(engines: Sequence[MockEngine], path: str | Path) -> None:
    """Draw each engine's KV usage and cumulative hit rate against simulated time to ``path``.

    The image format follows the file's extension (PNG for ``.png``). Raises `ImportError`
    without matplotlib and `OSError` if the file cannot be written.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 6), layout="constrained")
    usage_axes, hit_axes = figure.subplots(2, 1, sharex=True)
    for engine in engines:
        stats = engine.stats
        stride = max(1, len(stats.sample_times) // _MAX_POINTS)
        times = stats.sample_times[::stride]
        usage = [100 * u for u in stats.usage[::stride]]
        rates = [
            100 * hits / queries if queries else 0.0
            for hits, queries in zip(
                stats.hit_samples[::stride], stats.query_samples[::stride], strict=True
            )
        ]
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
    figure.savefig(path, dpi=100)
