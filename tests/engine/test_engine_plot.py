"""The ``--plot`` series: what is drawn is what the engine sampled, thinned honestly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpool.engine import EngineConfig, LocalKvClient, MockEngine
from kvpool.engine.metrics import EngineStats
from kvpool.engine.plot import check_plot_format, plot_series, write_plot


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


def test_the_plot_goes_to_exactly_the_path_given(tmp_path: Path) -> None:
    engine = MockEngine(LocalKvClient.create(64, 16), EngineConfig(num_gpu_blocks=64))
    engine.stats = stats_with(5)
    no_extension = tmp_path / "usage"
    write_plot([engine], no_extension)  # PNG, and no ".png" added to the name
    assert no_extension.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert list(tmp_path.iterdir()) == [no_extension]


def test_an_unknown_format_is_refused_with_the_choices() -> None:
    check_plot_format("usage.png")
    check_plot_format("usage.PDF")
    check_plot_format("usage")
    with pytest.raises(ValueError, match=r"cannot draw a \.foo file; use one of: .*png"):
        check_plot_format("usage.foo")
