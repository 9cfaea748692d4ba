"""What an engine counts while it runs, and the summary statistics reports use."""

from __future__ import annotations

import math
import operator
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvpool.engine.record import RequestRecord
from kvpool.manager.types import ManagerStats


@dataclass(slots=True)
class EngineStats:
    """One engine's counters and per-step samples (simulated time, seconds).

    Prefix-cache queries and hits are in tokens, counted once per admission the way the
    manager counts them: the request's tokens at that moment, and the cached prefix its
    first allocation reused; with prefix caching off nothing is queried (both stay 0, as
    vLLM reports no prefix-cache stats then).

    Samples (`record_sample`): the KV usage and the query and hit counters after a step,
    at ``sample_times``; the cache keeps that usage until the next step changes it, idle
    stretches included, so reports weigh each sample by how long it held. A sample equal
    to the previous one is not stored (it would only split that one's duration), so a
    run of decode-only steps costs no memory, and stepping one step at a time or
    fast-forwarding stores the same samples.

    Latency samples follow ``vllm bench serve``: ``ttft_s`` and ``latency_s`` (end to
    end) per finished request, ``tpot_s`` per finished request of more than one output
    token (``(latency - ttft) / (output - 1)``); ``itl_counts`` counts every gap between
    two consecutive output tokens of a request by value (`record_itl`: a decode step's
    requests share one gap, so a long run holds a few distinct values, not one per
    token). ``requests`` holds a `RequestRecord` per finished or rejected request, in
    that order. Float samples are ``array('d')``, counters ``array('q')``.
    """

    submitted: int = 0
    rejected: int = 0
    completed: int = 0
    aborted: int = 0  # dropped by `MockEngine.abort` (a client went away)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    event_batches: int = 0  # steps that told a router something (published if there is a sink)
    kv_events: int = 0  # the manager's count of router-visible events, as last read
    kv_events_batched: int = 0  # that count at the end of the last step with a batch
    sample_times: array[float] = field(default_factory=lambda: array("d"))
    usage: array[float] = field(default_factory=lambda: array("d"))
    query_samples: array[int] = field(default_factory=lambda: array("q"))
    hit_samples: array[int] = field(default_factory=lambda: array("q"))
    ttft_s: array[float] = field(default_factory=lambda: array("d"))
    latency_s: array[float] = field(default_factory=lambda: array("d"))
    tpot_s: array[float] = field(default_factory=lambda: array("d"))
    itl_counts: dict[float, int] = field(default_factory=dict)
    requests: list[RequestRecord] = field(default_factory=list)

    def record_sample(self, time: float, usage: float, queries: int, hits: int) -> None:
        """Sample the KV usage and the prefix counters at ``time``, unless all three
        equal the last sample's."""
        values = self.usage
        if (
            values
            and values[-1] == usage
            and self.query_samples[-1] == queries
            and self.hit_samples[-1] == hits
        ):
            return
        self.sample_times.append(time)
        values.append(usage)
        self.query_samples.append(queries)
        self.hit_samples.append(hits)

    def record_samples(
        self, times: list[float], usages: list[float], queries: int, hits: int
    ) -> None:
        """`record_sample` of each ``(times[i], usages[i])`` in order, all with the same
        counters: the samples of a jump's steps. What is kept goes into the arrays in one
        ``fromlist`` each, not one method call and item conversion per value (an
        ``array.append`` from compiled code is a generic method call: several hundred
        instructions)."""
        count = len(times)
        start = 0  # the first sample that differs from the arrays' last one
        values = self.usage
        if values and self.query_samples[-1] == queries and self.hit_samples[-1] == hits:
            last = values[-1]
            while start < count and usages[start] == last:
                start += 1
        if start == count:
            return
        # After it a sample is dropped when it equals the one before it (which, dropped
        # or not, equals the last kept). A caller that drops its own repeats (apply_jump)
        # hands over lists kept whole: nothing is copied, no float boxed again.
        repeats = False
        for i in range(start + 1, count):
            if usages[i] == usages[i - 1]:
                repeats = True
                break
        if repeats:
            kept_times = [times[start]]
            kept_usages = [usages[start]]
            for i in range(start + 1, count):
                if usages[i] != usages[i - 1]:
                    kept_times.append(times[i])
                    kept_usages.append(usages[i])
        else:
            kept_times = times[start:] if start else times
            kept_usages = usages[start:] if start else usages
        kept = len(kept_times)
        self.sample_times.fromlist(kept_times)
        values.fromlist(kept_usages)
        # the counters repeated as arrays: copied whole, not converted item by item
        self.query_samples.extend(array("q", (queries,)) * kept)
        self.hit_samples.extend(array("q", (hits,)) * kept)

    def record_itl(self, gap: float, count: int = 1) -> None:
        """Count ``count`` inter-token gaps of ``gap`` seconds."""
        counts = self.itl_counts
        counts[gap] = counts.get(gap, 0) + count

    def clear_samples(self) -> None:
        """Drop every sample and record (a long-running server keeps only counters)."""
        for samples in (
            self.sample_times,
            self.usage,
            self.query_samples,
            self.hit_samples,
            self.ttft_s,
            self.latency_s,
            self.tpot_s,
        ):
            del samples[:]  # arrays: no clear() before Python 3.13
        self.itl_counts.clear()
        self.requests.clear()


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default, which
    ``vllm bench serve`` uses); 0.0 for no values."""
    return percentile_of_sorted(sorted(values), q)


def percentile_of_sorted(ordered: Sequence[float], q: float) -> float:
    """`percentile` of values already in ascending order (sort once, ask many times)."""
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_of_counts(ordered: Sequence[float], cumulative: Sequence[int], q: float) -> float:
    """`percentile` of a multiset given as distinct ``ordered`` values and the running
    total of their counts (``cumulative[i]`` values are ``<= ordered[i]``)."""
    if not ordered:
        return 0.0
    rank = (cumulative[-1] - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, cumulative[-1] - 1)
    # the value at index i of the expanded, sorted multiset
    below = ordered[bisect_right(cumulative, low)]
    above = ordered[bisect_right(cumulative, high)]
    return below + (above - below) * (rank - low)


def sum_of_counts(counts: Mapping[float, int]) -> float:
    """The correctly rounded sum of every value times its count, as `math.fsum` of the
    expanded multiset gives it: ``value * count`` is split into exact ``value * 2**k``
    terms, one per bit of ``count``."""
    terms: list[float] = []
    for value, count in counts.items():
        while count:
            bit = count & -count
            terms.append(value * bit)
            count ^= bit
    return math.fsum(terms)


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; 0.0 for no values."""
    return math.fsum(values) / len(values) if values else 0.0


def held_durations(times: Sequence[float], end: float) -> list[float]:
    """How long each sample at ``times`` (ascending) held: until the next one, the last
    until ``end`` (never negative); none for no samples (an engine that never stepped)."""
    if not times:
        return []
    at = list(times)  # an array's values boxed once, in C, not item by item here
    held: list[float] = []
    for i in range(1, len(at)):
        step = at[i] - at[i - 1]
        held.append(step if step > 0.0 else 0.0)  # max(0.0, step), NaN and -0.0 included
    last = end - at[-1]
    held.append(last if last > 0.0 else 0.0)
    return held


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """The mean of ``values`` weighted by ``weights``; plain mean if they sum to 0."""
    mean_of, _ = _weighted(values, weights, [])
    return mean_of


def weighted_percentiles(
    values: Sequence[float], weights: Sequence[float], qs: Sequence[float]
) -> list[float]:
    """For each of ``qs`` (0..100), the smallest value that ``q`` percent of the weight
    lies at or below (0.0 for no values); with weights summing to 0, the unweighted
    `percentile`. One pass over the samples for all of them (a run's usage samples
    number one per step or jump: summed by level once, not once per ``q``)."""
    _, answers = _weighted(values, weights, qs, with_mean=False)
    return answers


def weighted_summary(
    values: Sequence[float], weights: Sequence[float], qs: Sequence[float]
) -> tuple[float, list[float], float]:
    """`weighted_mean`, `weighted_percentiles` of ``qs`` and the largest value (0.0 for
    none) of the same samples, the weights summed once (a report asks all three of
    100,000 usage samples)."""
    mean_of, answers = _weighted(values, weights, qs)
    return mean_of, answers, max(values, default=0.0)


def _weighted(
    values: Sequence[float], weights: Sequence[float], qs: Sequence[float], with_mean: bool = True
) -> tuple[float, list[float]]:
    """`weighted_mean` (0.0 without ``with_mean``) and `weighted_percentiles` of ``qs``.

    The sums are exactly the definitions': ``math.fsum`` is correctly rounded whatever
    the order, and each level's weight is added up in sample order, from 0.0."""
    total = math.fsum(weights)
    if total <= 0:
        ordered = sorted(values)
        return mean(values) if with_mean else 0.0, [percentile_of_sorted(ordered, q) for q in qs]
    if len(values) != len(weights):
        raise ValueError("values and weights differ in length")
    # the products and their sum in C (map, fsum), each product rounded as v * w rounds
    mean_of = math.fsum(map(operator.mul, values, weights)) / total if with_mean else 0.0
    if not qs:
        return mean_of, []
    # few distinct levels (a usage is active / capacity): each level's running sum is
    # kept in ``sums`` at the place ``place_of`` gives it (one dict lookup a sample)
    place_of: dict[float, int] = {}
    sums: list[float] = []
    for value, weight in zip(values, weights, strict=True):
        place = place_of.get(value, -1)
        if place < 0:
            place_of[value] = len(sums)
            sums.append(0.0 + weight)
        else:
            sums[place] += weight
    levels = sorted(place_of)
    level_sums = [sums[place_of[value]] for value in levels]
    # The running weight at each level: the same sums, in the same order, for every q.
    running: list[float] = []
    seen = 0.0
    for weight in level_sums:
        seen += weight
        running.append(seen)
    answers: list[float] = []
    for q in qs:
        target = total * q / 100.0
        found = False
        answer = 0.0
        for i in range(len(levels)):
            if running[i] >= target and level_sums[i] > 0:
                answer = levels[i]
                found = True
                break
        if not found:
            answer = max(value for value, place in place_of.items() if sums[place] > 0)
        answers.append(answer)
    return mean_of, answers


def read_counters(stats: EngineStats, counters: ManagerStats) -> None:
    """Copy the counters the engine does not keep itself: the pool counts evictions, the
    manager prefix-cache queries, hits and router-visible events."""
    stats.evictions = counters.evictions
    stats.prefix_query_tokens = counters.prefix_query_tokens
    stats.prefix_hit_tokens = counters.prefix_hit_tokens
    stats.kv_events = counters.kv_events


def close_batch(stats: EngineStats) -> bool:
    """At a step's end, once its counters are read: True (and one more batch counted) if
    the step told a router something, which its KV calls' events then hold (none when
    the manager builds no events). Every KV call that queues an event drains it, and the
    engine reads its counters, within the step."""
    if stats.kv_events == stats.kv_events_batched:
        return False
    stats.kv_events_batched = stats.kv_events
    stats.event_batches += 1
    return True
