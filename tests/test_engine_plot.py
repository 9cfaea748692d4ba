"""The ``--plot`` series: what is drawn is what the engine sampled, thinned honestly."""

from __future__ import annotations

import math

from kvpool.engine.metrics import EngineStats
from kvpool.engine.plot import plot_series


def stats_with(samples: int) -> EngineStats:
    """Busy steps at 50% usage, then the idle cache (0%) after the last request."""
    stats = EngineStats()
    for i in range(samples):
        stats.sample_times.append(0.01 * (i + 1))
        stats.usage.append(0.5 if i < samples - 1 else 0.0)
        stats.query_samples.append(0 if i < 2 else 100 * i)
        stats.hit_samples.append(0 if i < 2 else 50 * i)
    return stats


def test_thinning_keeps_the_last_sample_the_idle_cache() -> None:
    stats = stats_with(10)
    times, usage, _ = plot_series(stats, max_points=3)  # stride 3: 0, 3, 6, 9... and 9
    assert len(times) < 10
    assert times[-1] == stats.sample_times[-1]
    assert usage[-1] == 0.0
    stats = stats_with(11)  # stride 3 picks 0, 3, 6, 9: the last (10) must be added
    times, usage, _ = plot_series(stats, max_points=3)
    assert times[-1] == stats.sample_times[-1]
    assert usage[-1] == 0.0
    assert times == sorted(set(times))


def test_the_hit_rate_is_undefined_before_the_first_query() -> None:
    _, usage, rates = plot_series(stats_with(5))
    assert usage == [50.0, 50.0, 50.0, 50.0, 0.0]
    assert math.isnan(rates[0])
    assert math.isnan(rates[1])
    assert rates[2:] == [50.0, 50.0, 50.0]


def test_no_samples_no_points() -> None:
    assert plot_series(EngineStats()) == ([], [], [])
