"""Workloads: the synthetic default, Mooncake trace parsing and its error messages."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import KvpoolError, PoolError, TraceError
from kvpool.hashing import TOKEN_TYPECODE
from kvpool.hashing.runs import TOKEN_MASK, TokenRuns
from kvpool.workloads import (
    MooncakeTrace,
    RequestSpec,
    Segment,
    SyntheticWorkload,
    TraceWarning,
    default_workload,
    mix_seed,
    parse_mooncake_lines,
    read_mooncake_trace,
)
from kvpool.workloads.spec import seed_mixer
from kvpool.workloads.tokens import segment_token_array, segment_tokens

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TRACE = ROOT / "kvpool" / "data" / "sample_trace.jsonl"


def record(**fields: object) -> str:
    base: dict[str, object] = {
        "timestamp": 0,
        "input_length": 600,
        "output_length": 5,
        "hash_ids": [1, 2],
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...})


# ------------------------------------------------------------------ segments and specs


def test_segment_tokens_are_deterministic_u32_and_sliceable() -> None:
    segment = Segment(2**32 - 3, 6)  # wraps around 2**32
    tokens = segment.tokens()
    assert tokens == [2**32 - 3, 2**32 - 2, 2**32 - 1, 0, 1, 2]
    assert segment.tokens(2, 4) == tokens[2:4]
    assert [segment.token(j) for j in range(6)] == tokens


def test_request_spec_concatenates_its_segments() -> None:
    spec = RequestSpec("r", 1.5, (Segment(10, 3), Segment(100, 2)), Segment(7, 4))
    assert spec.input_length == 5
    assert spec.output_length == 4
    assert spec.prompt_token_ids() == [10, 11, 12, 100, 101]


def test_prompt_token_arrays_are_u32_copies_of_the_prompt() -> None:
    """The engine's form of the prompt: segments come from a shared cache, so a caller
    changing its array must not change the next prompt that shares a segment."""
    spec = RequestSpec("r", 0.0, (Segment(2**32 - 1, 2), Segment(5, 3)), Segment(7, 1))
    tokens = spec.prompt_token_array()
    assert tokens.typecode == TOKEN_TYPECODE
    assert tokens.tolist() == spec.prompt_token_ids() == [2**32 - 1, 0, 5, 6, 7]
    tokens[0] = 1
    tokens.append(9)
    again = RequestSpec("s", 0.0, (Segment(5, 3),), Segment(7, 1)).prompt_token_array()
    assert again.tolist() == [5, 6, 7]
    assert spec.prompt_token_array().tolist() == [2**32 - 1, 0, 5, 6, 7]


@given(
    st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 5)), min_size=1, max_size=6).filter(
        lambda pieces: any(length for _, length in pieces)
    ),
    st.booleans(),
)
def test_prompt_token_runs_are_the_runs_the_constructor_makes(
    pieces: list[tuple[int, int]], with_tokens: bool
) -> None:
    """`RequestSpec.prompt_token_runs` skips the checks (`TokenRuns.of_checked`): what
    it makes is what `TokenRuns` makes of the same runs, checked."""
    spec = RequestSpec("r", 0.0, tuple(Segment(*piece) for piece in pieces), Segment(7, 1))
    made = spec.prompt_token_runs(with_tokens=with_tokens)
    checked = TokenRuns(
        [(seed & TOKEN_MASK, length) for seed, length in pieces],
        tokens=spec.prompt_token_array() if with_tokens else None,
    )
    assert made.runs == checked.runs
    assert len(made) == len(checked) == spec.input_length
    assert list(made) == list(checked) == spec.prompt_token_ids()
    assert made.to_array() == checked.to_array()


@pytest.mark.parametrize(
    ("prompt", "output", "arrival", "message"),
    [
        ((), Segment(1, 1), 0.0, "at least 1 token|>= 1 token"),
        ((Segment(1, 3),), Segment(1, 0), 0.0, "output_length"),
        ((Segment(1, 3),), Segment(1, 1), -1.0, "arrival"),
        ((Segment(1, -3), Segment(2, 5)), Segment(1, 1), 0.0, "negative"),
    ],
)
def test_request_spec_refuses_impossible_requests(
    prompt: tuple[Segment, ...], output: Segment, arrival: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RequestSpec("bad", arrival, prompt, output)


# ---------------------------------------------------------------------- synthetic


def test_the_default_workload_is_seeded() -> None:
    first = default_workload(seed=7)
    assert first == default_workload(seed=7)
    assert first != default_workload(seed=8)
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals)
    assert len({r.request_id for r in first}) == len(first)


def test_a_session_turn_extends_the_previous_turn_and_its_answer() -> None:
    requests = {r.request_id: r for r in SyntheticWorkload(seed=5, num_sessions=30).requests()}
    later = [r for r in requests.values() if not r.request_id.endswith("-t0")]
    assert later, "the mix has multi-turn sessions"
    for request in later:
        session, turn = request.request_id.rsplit("-t", 1)
        previous = requests[f"{session}-t{int(turn) - 1}"]
        context = previous.prompt_token_ids() + previous.output.tokens()
        assert request.prompt_token_ids()[: len(context)] == context
        assert request.arrival_s > previous.arrival_s


def test_sessions_share_system_prompts() -> None:
    requests = SyntheticWorkload(seed=0, num_sessions=40, num_system_prompts=3).requests()
    first_segments = {r.prompt[0] for r in requests}
    assert len(first_segments) <= 3
    assert len(requests) > 3 * len(first_segments)


# ------------------------------------------------------------------------ mooncake


def test_mooncake_records_become_requests_with_shared_prefixes() -> None:
    lines = [
        record(timestamp=2500, input_length=1100, output_length=3, hash_ids=[7, 8, 9]),
        "",
        record(timestamp=1000, input_length=700, output_length=9, hash_ids=[7, 4]),
    ]
    late, early = None, None
    for request in parse_mooncake_lines(lines, source="t.jsonl"):
        if request.request_id == "line-1":
            late = request
        else:
            early = request
    assert late is not None
    assert early is not None
    assert (early.arrival_s, late.arrival_s) == (1.0, 2.5)
    assert (early.input_length, late.input_length) == (700, 1100)
    assert (early.output_length, late.output_length) == (9, 3)
    assert [s.length for s in late.prompt] == [512, 512, 76]
    # equal ids, equal tokens: the first 512 tokens are shared, the next are not
    assert early.prompt_token_ids()[:512] == late.prompt_token_ids()[:512]
    assert early.prompt_token_ids()[512:600] != late.prompt_token_ids()[512:600]


def test_a_read_request_equals_the_one_built_and_checked_from_its_fields() -> None:
    # the reader builds its specs with RequestSpec.checked (the record states the
    # prompt's length): each must equal the spec constructed, and checked, afresh
    lines = [
        record(timestamp=2500, input_length=1100, output_length=3, hash_ids=[7, 8, 9]),
        record(timestamp=0.5, input_length=1024, output_length=1, hash_ids=[7, 8]),
        record(timestamp=7, input_length=1, output_length=2, hash_ids=[2**64 - 1]),
    ]
    for request in parse_mooncake_lines(lines, source="t.jsonl"):
        built = RequestSpec(request.request_id, request.arrival_s, request.prompt, request.output)
        assert request == built
        assert request.input_length == built.input_length
        assert request.output.seed == mix_seed(2, int(request.request_id.removeprefix("line-")))


@given(st.lists(st.integers(-(2**70), 2**70), max_size=3), st.integers(-(2**70), 2**70))
def test_a_seed_mixer_is_mix_seed_with_its_prefix(prefix: list[int], part: int) -> None:
    assert seed_mixer(*prefix)(part) == mix_seed(*prefix, part)


def test_requests_come_out_in_timestamp_order() -> None:
    lines = [record(timestamp=t) for t in (30, 10, 20, 10)]
    requests = parse_mooncake_lines(lines)
    assert [r.request_id for r in requests] == ["line-2", "line-4", "line-3", "line-1"]


def test_the_trace_block_size_sets_how_many_ids_a_prompt_needs() -> None:
    [request] = parse_mooncake_lines(
        [record(input_length=40, hash_ids=[1, 2, 3])], trace_block_size=16
    )
    assert [s.length for s in request.prompt] == [16, 16, 8]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not a JSON object"),
        ("[1, 2, 3]", "Expected `object`"),
        (record(hash_ids=...), "missing required field `hash_ids`"),
        (record(session_id=4), "unknown field `session_id`"),
        (record(input_length=-5), "input_length must be >= 1, got -5"),
        (record(output_length=-1), "output_length must be >= 1, got -1"),
        (record(output_length=0), "output_length must be >= 1, got 0"),
        (record(timestamp=-3), "timestamp must be >= 0"),
        (record(timestamp="soon"), "Expected `int | float`, got `str`"),
        (record(input_length=6.5), "Expected `int`, got `float`"),
        (record(hash_ids=[1]), "hash_ids holds 1 ids but input_length 600 needs 2"),
        (record(hash_ids=[1, 2, 3]), "hash_ids holds 3 ids"),
        (record(hash_ids=[1, -2]), r"hash_ids must be ints in \[0, 2\*\*64\)"),
        (record(hash_ids=[1, 2**64]), r"hash_ids must be ints in \[0, 2\*\*64\)"),
        # absurd values: no machine could run them, so they are bad lines, not requests
        (record(timestamp=1e300), r"timestamp must be <= 1e\+12 ms"),
        (record(timestamp=10**30), r"timestamp must be <= 1e\+12 ms"),
        (record().replace('"timestamp": 0', '"timestamp": 1e400'), "Number out of range"),
        ('{"timestamp": NaN}', "not a JSON object"),
        (record(timestamp=-1e-9), "timestamp must be >= 0"),
        (record(input_length=2**30 + 1), r"input_length must be <= 2\*\*30 tokens"),
        (record(output_length=10**40), r"output_length must be <= 2\*\*30 tokens"),
    ],
)
def test_a_bad_line_is_named_with_its_number(line: str, message: str) -> None:
    lines = [record(), "", line, record()]
    with pytest.raises(TraceError, match=message) as caught:
        parse_mooncake_lines(lines, source="bad.jsonl")
    assert caught.value.line == 3
    assert str(caught.value).startswith("bad.jsonl:3: ")


def test_an_empty_trace_is_an_error() -> None:
    with pytest.raises(TraceError, match="no request"):
        parse_mooncake_lines(["", "  "], source="empty.jsonl")


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace") as caught:
        read_mooncake_trace(tmp_path / "nope.jsonl")
    assert caught.value.line is None


def test_a_bad_trace_block_size_is_an_error() -> None:
    with pytest.raises(TraceError, match="trace block size"):
        parse_mooncake_lines([record()], trace_block_size=0)


def test_the_shipped_sample_trace_reads_and_is_reproducible() -> None:
    requests = read_mooncake_trace(SAMPLE_TRACE)
    assert 200 <= len(requests) <= 1000
    first_blocks = [r.prompt[0] for r in requests]
    assert len(set(first_blocks)) < len(first_blocks) / 10  # shared prefixes
    spec = importlib.util.spec_from_file_location(
        "make_sample_trace", ROOT / "benchmarks" / "make_sample_trace.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    regenerated = "".join(line + "\n" for line in module.sample_trace_lines())
    assert SAMPLE_TRACE.read_text() == regenerated


def test_the_shipped_sample_trace_uses_each_hash_id_at_one_block_size() -> None:
    # aiperf's Mooncake loader rule, checked without aiperf: an id is one block of
    # fixed content, so every use of it covers the same number of tokens.
    sizes: dict[int, set[int]] = {}
    for line in SAMPLE_TRACE.read_text().splitlines():
        entry = json.loads(line)
        ids = entry["hash_ids"]
        for i, hash_id in enumerate(ids):
            tokens = min(512, entry["input_length"] - 512 * i)
            sizes.setdefault(hash_id, set()).add(tokens)
    assert all(len(used) == 1 for used in sizes.values())
    assert any(512 not in used for used in sizes.values())  # partial blocks are in it


def test_a_hash_id_used_at_two_sizes_is_warned_about_naming_the_first_line(
    tmp_path: Path,
) -> None:
    # line 1's id 2 is a partial block of 88 tokens; line 3 uses it full (512)
    lines = [
        record(input_length=600, hash_ids=[1, 2]),
        record(input_length=600, hash_ids=[1, 2]),
        record(input_length=1100, hash_ids=[1, 2, 3]),
        record(input_length=100, hash_ids=[3]),
    ]
    path = write_trace(tmp_path / "t.jsonl", lines)
    message = r"t\.jsonl: line 3: hash id 2 stands for a block of 512 tokens, and of 88 at line 1"
    with pytest.warns(TraceWarning, match=message) as caught:
        trace = MooncakeTrace(path)
    assert len(caught) == 1  # only the first such line
    assert len(trace) == 4  # and the trace runs
    trace.close()
    with pytest.warns(TraceWarning, match="line 3: hash id 2"):
        parse_mooncake_lines(lines, source="t.jsonl")


def test_a_trace_error_is_a_kvpool_error_and_not_a_refused_pool_call() -> None:
    with pytest.raises(TraceError) as caught:
        parse_mooncake_lines([record(timestamp=1e300)], source="t.jsonl")
    assert isinstance(caught.value, KvpoolError)
    assert not isinstance(caught.value, PoolError)
    assert str(caught.value).splitlines() == [str(caught.value)]  # one line


# ------------------------------------------------------------------ held traces


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_trace_is_read_once_and_held(tmp_path: Path) -> None:
    trace_path = write_trace(tmp_path / "t.jsonl", [record(timestamp=t) for t in (1, 2, 3)])
    trace = MooncakeTrace(trace_path)
    assert len(trace) == 3
    assert trace.in_order
    # held: the file is not read again, so a line appended (or the file removed) after
    # construction changes nothing
    with trace_path.open("a") as file:
        file.write("{broken\n")
    first = list(trace)
    trace_path.unlink()
    assert [request.arrival_s for request in first] == [0.001, 0.002, 0.003]
    assert list(trace) == first
    trace.close()  # drops them
    assert list(trace) == []


def test_a_trace_can_be_iterated_again(tmp_path: Path) -> None:
    with MooncakeTrace(SAMPLE_TRACE) as trace:
        first = list(trace)
        assert first == list(trace)
    assert first == read_mooncake_trace(SAMPLE_TRACE)


def test_a_trace_out_of_order_is_held_and_sorted(tmp_path: Path) -> None:
    lines = [record(timestamp=t) for t in (30, 10, 20, 10)]
    trace = MooncakeTrace(write_trace(tmp_path / "t.jsonl", lines))
    assert not trace.in_order
    assert [r.request_id for r in trace] == ["line-2", "line-4", "line-3", "line-1"]


def test_a_bad_line_fails_construction_naming_it(tmp_path: Path) -> None:
    lines = [record(), record(timestamp=1e300), record()]
    with pytest.raises(TraceError, match=r"t.jsonl:2: timestamp must be <= 1e\+12 ms"):
        MooncakeTrace(write_trace(tmp_path / "t.jsonl", lines))
    with pytest.raises(TraceError, match="no request"):
        MooncakeTrace(write_trace(tmp_path / "empty.jsonl", ["", " "]))
    with pytest.raises(TraceError, match="cannot read the trace"):
        MooncakeTrace(tmp_path / "missing.jsonl")


def test_a_gzip_trace_is_read_whatever_its_name(tmp_path: Path) -> None:
    packed = tmp_path / "trace.data"  # known by its magic bytes, not its name
    packed.write_bytes(gzip.compress(SAMPLE_TRACE.read_bytes()))
    assert list(MooncakeTrace(packed)) == read_mooncake_trace(SAMPLE_TRACE)
    assert read_mooncake_trace(packed) == read_mooncake_trace(SAMPLE_TRACE)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(SAMPLE_TRACE.read_bytes())[:200])
    with pytest.raises(TraceError, match=r"broken.jsonl.gz: cannot read the trace"):
        MooncakeTrace(broken)


def test_dash_reads_standard_input_once_and_yields_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(SAMPLE_TRACE.read_bytes()))
    monkeypatch.setattr(sys, "stdin", stdin)
    with MooncakeTrace("-") as trace:
        assert trace.source == "<stdin>"
        assert list(trace) == list(trace) == read_mooncake_trace(SAMPLE_TRACE)
    bad = io.TextIOWrapper(io.BytesIO(b"\n" + record(output_length=0).encode()))
    monkeypatch.setattr(sys, "stdin", bad)
    with pytest.raises(TraceError, match="<stdin>:2: output_length must be >= 1"):
        MooncakeTrace("-")


@given(
    seed=st.integers(0, 2**40) | st.integers(2**32 - 5000, 2**32 - 1),
    length=st.integers(0, 5000) | st.sampled_from([1, 511, 512, 4096, 4097]),
)
def test_a_segments_token_array_is_its_tokens(seed: int, length: int) -> None:
    """The arithmetic path (one big integer per run) and the token-by-token one agree,
    wrap-around past 2**32 and runs past 4,096 tokens included."""
    tokens = segment_token_array(seed, length)
    assert tokens.typecode == TOKEN_TYPECODE
    assert (
        tokens.tolist() == segment_tokens(seed, length, 0, length) == Segment(seed, length).tokens()
    )
