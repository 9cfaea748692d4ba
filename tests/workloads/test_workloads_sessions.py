"""Dynamo replay's synthetic workload (`SyntheticSessions`): shapes, arrivals, prefix
groups, sessions and seeds."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidArgumentError
from kvpool.workloads import Session, SyntheticSessions


def test_every_request_has_the_lengths_asked_for_in_sessions_of_n_turns() -> None:
    workload = SyntheticSessions(
        input_tokens=100,
        output_tokens=7,
        request_count=5,
        arrival_interval_s=0.5,
        turns_per_session=3,
        inter_turn_delay_s=0.25,
    )
    sessions = workload.sessions()
    assert len(sessions) == 5
    for session in sessions:
        assert session.num_turns == 3
        assert session.delay_s == 0.25
        for turn in (session.first, *session.rest):
            assert turn.input_length == 100
            assert turn.output_length == 7
    ids = [t.request_id for s in sessions for t in (s.first, *s.rest)]
    assert len(set(ids)) == 15


def test_a_fixed_interval_starts_a_session_every_interval_from_zero() -> None:
    workload = SyntheticSessions(10, 1, 4, arrival_interval_s=0.125)
    assert [s.arrival_s for s in workload.sessions()] == [0.0, 0.125, 0.25, 0.375]


def test_without_a_rate_every_session_starts_at_zero_for_a_closed_loop() -> None:
    assert {s.arrival_s for s in SyntheticSessions(10, 1, 4).sessions()} == {0.0}


def test_poisson_arrivals_start_at_zero_with_the_rate_asked_for() -> None:
    sessions = SyntheticSessions(10, 1, 4001, request_rate=20.0).sessions()
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / 4000
    assert mean_gap == pytest.approx(1 / 20.0, rel=0.1)


@pytest.mark.parametrize(
    ("ratio", "prefix"),
    # Dynamo rounds the shared prefix up to whole blocks: 50 tokens -> 4 blocks of 16
    # (its replay reuses 64 tokens), 30 -> 2 blocks (32)
    [(0.5, 64), (0.3, 32), (1.0, 100), (0.01, 16)],
)
def test_the_shared_prefix_is_rounded_up_to_whole_blocks(ratio: float, prefix: int) -> None:
    workload = SyntheticSessions(
        100, 1, 1, shared_prefix_ratio=ratio, num_prefix_groups=1, block_size=16
    )
    assert workload.prefix_tokens == prefix
    [session] = workload.sessions()
    assert session.first.prompt[0].length == prefix
    assert session.first.input_length == 100


def test_sessions_of_a_group_share_its_prefix_and_their_own_tokens_differ() -> None:
    workload = SyntheticSessions(
        100, 1, 40, turns_per_session=2, shared_prefix_ratio=0.5, num_prefix_groups=3
    )
    sessions = workload.sessions()
    heads = {turn.prompt[0] for s in sessions for turn in (s.first, *s.rest)}
    assert len(heads) == 3  # 40 sessions picked each of the 3 groups
    for session in sessions:  # a session keeps its group for every turn
        assert session.first.prompt[0] == session.rest[0].prompt[0]
    tails = {turn.prompt[1] for s in sessions for turn in (s.first, *s.rest)}
    assert len(tails) == 80


def test_no_groups_means_no_shared_prefix() -> None:
    [session] = SyntheticSessions(100, 1, 1, shared_prefix_ratio=0.5).sessions()
    assert len(session.first.prompt) == 1


def test_a_seed_names_the_workload() -> None:
    def make(seed: int) -> list[Session]:
        return SyntheticSessions(
            50, 2, 20, request_rate=5.0, shared_prefix_ratio=0.5, num_prefix_groups=4, seed=seed
        ).sessions()

    assert make(3) == make(3)
    assert make(3) != make(4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_tokens": 0},
        {"request_count": 0},
        {"turns_per_session": 0},
        {"num_prefix_groups": -1},
        {"shared_prefix_ratio": 1.5},
        {"request_rate": 0.0},
        {"request_rate": 1.0, "arrival_interval_s": 1.0},
        {"arrival_interval_s": -1.0},
        {"inter_turn_delay_s": float("inf")},
        {"block_size": 0},
    ],
)
def test_bad_knobs_are_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {"input_tokens": 10, "output_tokens": 1, "request_count": 1}
    with pytest.raises(InvalidArgumentError):
        SyntheticSessions(**{**base, **kwargs})  # type: ignore[arg-type]


def test_a_session_delay_must_be_finite() -> None:
    [session] = SyntheticSessions(10, 1, 1).sessions()
    with pytest.raises(InvalidArgumentError):
        Session(session.first, (), -1.0)
