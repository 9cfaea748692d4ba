"""`weighted_percentiles`: every q from one pass, equal to the definition asked per q.
`weighted_summary`: the mean, percentiles and maximum, each as defined alone.
`EngineStats.record_samples`: the samples `record_sample` one at a time would keep."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvpool.engine.metrics import (
    EngineStats,
    mean,
    percentile,
    weighted_percentiles,
    weighted_summary,
)


def _one(values: list[float], weights: list[float], q: float) -> float:
    """The definition, asked for one q: walk the levels in order until q% of the weight."""
    total = math.fsum(weights)
    if total <= 0:
        return percentile(values, q)
    by_value: dict[float, float] = {}
    for value, weight in zip(values, weights, strict=True):
        by_value[value] = by_value.get(value, 0.0) + weight
    seen = 0.0
    for value in sorted(by_value):
        seen += by_value[value]
        if seen >= total * q / 100.0 and by_value[value] > 0:
            return value
    return max(value for value, weight in by_value.items() if weight > 0)


levels = st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75, 1.0, 1 / 3])
durations = st.one_of(st.just(0.0), st.floats(1e-6, 5.0))


@given(
    st.lists(st.tuples(levels, durations), max_size=40),
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=5),
)
def test_all_qs_at_once_equal_each_q_alone(
    samples: list[tuple[float, float]], qs: list[float]
) -> None:
    values = [value for value, _ in samples]
    weights = [weight for _, weight in samples]
    assert weighted_percentiles(values, weights, qs) == [_one(values, weights, q) for q in qs]


def test_a_level_held_longest_is_the_median() -> None:
    assert weighted_percentiles([0.5, 1.0, 0.25], [1.0, 8.0, 1.0], [50, 5, 99]) == [
        1.0,
        0.25,
        1.0,
    ]


usages = st.sampled_from([0.0, 0.25, 0.5, 1 / 3])
counters = st.sampled_from([0, 7])


@given(
    st.lists(st.tuples(usages, counters, counters), max_size=6),
    st.lists(usages, max_size=12),
    counters,
    counters,
)
def test_record_samples_keeps_what_record_sample_keeps(
    before: list[tuple[float, int, int]], batch: list[float], queries: int, hits: int
) -> None:
    one, many = EngineStats(), EngineStats()
    for i, (usage, q, h) in enumerate(before):  # whatever the arrays already hold
        one.record_sample(float(i), usage, q, h)
        many.record_sample(float(i), usage, q, h)
    times = [100.0 + i for i in range(len(batch))]
    for time, usage in zip(times, batch, strict=True):
        one.record_sample(time, usage, queries, hits)
    many.record_samples(times, batch, queries, hits)
    assert many.sample_times == one.sample_times
    assert many.usage == one.usage
    assert many.query_samples == one.query_samples
    assert many.hit_samples == one.hit_samples


@given(st.lists(st.tuples(levels, durations), max_size=40))
def test_weighted_summary_is_each_figure_alone(samples: list[tuple[float, float]]) -> None:
    values = [value for value, _ in samples]
    weights = [weight for _, weight in samples]
    total = math.fsum(weights)
    expected_mean = (
        math.fsum(v * w for v, w in zip(values, weights, strict=True)) / total
        if total > 0
        else mean(values)
    )
    got_mean, got_qs, got_max = weighted_summary(values, weights, (50, 90, 99))
    assert got_mean == expected_mean
    assert got_qs == [_one(values, weights, q) for q in (50, 90, 99)]
    assert got_max == max(values, default=0.0)
