"""Run keys (`kvpool.hashing.runs`): blocks named from their token runs, with no token
built, give the same cache as Dynamo's token hashes: same reports, same records."""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.engine import EngineConfig, KvClient, LocalKvClient
from kvpool.engine.runner import open_local_kv, run_simulation
from kvpool.errors import InvalidArgumentError
from kvpool.hashing import TOKEN_TYPECODE, BlockHasher, block_hashes
from kvpool.hashing.run_keys import RunKeyer, RunMemo
from kvpool.hashing.runs import TokenRuns
from kvpool.manager import KvManager
from kvpool.pool import BlockPool
from kvpool.workloads import RequestSpec, parse_mooncake_lines
from kvpool.workloads.tokens import segment_span, segment_tokens

MASK = (1 << 32) - 1


def _tokens(runs: list[tuple[int, int]]) -> list[int]:
    return [(start + j) & MASK for start, length in runs for j in range(length)]


runs_strategy = st.lists(
    st.tuples(st.sampled_from([0, 5, 16, 40, MASK - 3, MASK]), st.integers(0, 40)),
    max_size=6,
)


@given(runs=runs_strategy, cut=st.integers(0, 200), block_size=st.sampled_from([1, 3, 4, 16]))
def test_keys_depend_on_the_tokens_only_however_the_runs_are_cut(
    runs: list[tuple[int, int]], cut: int, block_size: int
) -> None:
    tokens = _tokens(runs)
    whole = RunKeyer(block_size)
    whole.extend(TokenRuns(runs))
    # the same tokens fed one by one, and in two pieces at an arbitrary cut
    single = RunKeyer(block_size)
    for token in tokens:
        single.extend(TokenRuns([(token, 1)]))
    split = RunKeyer(block_size)
    split.extend(TokenRuns.from_tokens(tokens[:cut]))
    split.extend(TokenRuns.from_tokens(tokens[cut:]))
    assert whole.hashes == single.hashes == split.hashes
    assert len(whole.hashes) == len(tokens) // block_size
    assert list(TokenRuns(runs)) == tokens == TokenRuns(runs).to_array().tolist()


@given(
    runs=st.lists(
        st.tuples(st.sampled_from([0, 3, 64, 200, MASK - 99]), st.integers(0, 300)),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 1300), max_size=4),
    block_size=st.sampled_from([1, 2, 3]),
)
def test_long_runs_cut_anywhere_key_as_one_piece(
    runs: list[tuple[int, int]], cuts: list[int], block_size: int
) -> None:
    """Runs longer than a stretch of keys (`RANGE_BLOCKS` blocks), fed in pieces cut
    anywhere (inside a block, on a stretch's edge), get the keys fed whole gets; a block
    that only continues another sequence's run shares nothing with it."""
    tokens = _tokens(runs)
    whole = RunKeyer(block_size)
    whole.extend(TokenRuns(runs))
    pieces = RunKeyer(block_size)
    edges = [0, *sorted(cut for cut in cuts if cut < len(tokens)), len(tokens)]
    for lo, hi in itertools.pairwise(edges):
        pieces.extend(TokenRuns.from_tokens(tokens[lo:hi]))
    assert pieces.hashes == whole.hashes
    assert len(set(whole.hashes)) == len(whole.hashes)  # a chain never repeats a key
    # the same tokens one block later: a key is shared exactly where the prefixes agree
    shifted = tokens[block_size:]
    later = RunKeyer(block_size)
    later.extend(TokenRuns.from_tokens(shifted))
    agree = next(
        (i for i, (x, y) in enumerate(zip(shifted, tokens, strict=False)) if x != y),
        len(shifted),
    )
    where = {key: index for index, key in enumerate(whole.hashes)}
    for index, key in enumerate(later.hashes):
        shared = (index + 1) * block_size <= agree
        assert where.get(key, -1) == (index if shared else -1)


@given(
    a=st.lists(st.integers(0, 6), min_size=4, max_size=24),
    b=st.lists(st.integers(0, 6), min_size=4, max_size=24),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_two_sequences_share_a_key_exactly_when_they_share_the_prefix(
    a: list[int], b: list[int], block_size: int
) -> None:
    keys = []
    for tokens in (a, b):
        keyer = RunKeyer(block_size)
        keyer.extend(TokenRuns.from_tokens(tokens))
        keys.append(keyer.hashes)
    for i in range(min(len(keys[0]), len(keys[1]))):
        end = (i + 1) * block_size
        assert (keys[0][i] == keys[1][i]) == (a[:end] == b[:end])


@given(runs=runs_strategy, cut=st.integers(0, 200), block_size=st.sampled_from([1, 3, 4, 16]))
def test_runs_hashed_through_the_memo_are_dynamos_hashes(
    runs: list[tuple[int, int]], cut: int, block_size: int
) -> None:
    tokens = _tokens(runs)
    memo = RunMemo(block_size)
    for _ in range(2):  # the second pass is answered by the memo
        hasher = BlockHasher(block_size)
        first = TokenRuns.from_tokens(tokens[:cut])
        last = TokenRuns.from_tokens(tokens[cut + 5 :])
        new = hasher.extend_runs(first, first.to_array(), memo)
        new += hasher.extend(tokens[cut : cut + 5])  # plain tokens between runs
        new += hasher.extend_runs(last, last.to_array(), memo)
        assert hasher.hashes == new == block_hashes(tokens, block_size)


def test_token_runs_are_checked() -> None:
    for bad in ([(1 << 32, 1)], [(-1, 1)], [(0, -1)], [(0, 1, 2)], [[0, 1]]):
        with pytest.raises(InvalidArgumentError):
            TokenRuns(bad)  # type: ignore[arg-type]
    runs = TokenRuns([(MASK, 3), (7, 0)])
    assert list(runs) == [MASK, 0, 1]
    assert len(runs) == 3
    assert runs[-1] == 1
    assert runs[1:] == [0, 1]
    with pytest.raises(IndexError):
        runs[3]


@given(
    seed=st.sampled_from([0, 7, MASK - 5, MASK]),
    length=st.integers(1, 12),
    start=st.integers(0, 12),
    stop=st.integers(0, 14),
)
def test_a_segment_span_is_its_tokens(seed: int, length: int, start: int, stop: int) -> None:
    span = segment_span(seed, length, start, stop)
    assert list(span) == segment_tokens(seed, length, start, stop)


def test_run_keys_need_events_off() -> None:
    with pytest.raises(InvalidArgumentError, match="run_keys"):
        KvManager(BlockPool(4), 4, run_keys=True)
    with pytest.raises(InvalidArgumentError, match="run_keys"):
        KvManager(BlockPool(4), 4, enable_kv_cache_events=False, run_keys=1)


def test_a_run_keyed_manager_takes_plain_tokens_too() -> None:
    """Any caller's tokens (a list, an array, runs) name the same blocks."""
    keyed = KvManager(BlockPool(16), 4, enable_kv_cache_events=False, run_keys=True)
    prompt = [9, 10, 11, 12, 13, 3, 3, 3, 4, 5]
    keyed.add_request("list", prompt)
    keyed.add_request("array", array(TOKEN_TYPECODE, prompt))
    keyed.add_request("runs", TokenRuns([(9, 5), (3, 1), (3, 1), (3, 3)]))
    assert keyed.block_hashes("list") == keyed.block_hashes("array") == keyed.block_hashes("runs")
    assert keyed.num_tokens("runs") == 10
    keyed.allocate("list", 10, cache=True)
    cost = keyed.prefill_cost("runs")
    assert (cost.cached_blocks, cost.active_cached_blocks) == (2, 2)
    keyed.append_tokens("list", [6, 7])
    keyed.append_tokens("runs", TokenRuns([(6, 2)]))
    keyed.append_tokens("array", range(6, 8))
    assert keyed.block_hashes("list") == keyed.block_hashes("runs") == keyed.block_hashes("array")
    with pytest.raises(InvalidArgumentError):
        keyed.append_tokens("list", range(MASK, MASK + 2))  # not u32: refused, as a list is
    assert keyed.num_tokens("list") == 12
    keyed.check_invariants()


# ---------------------------------------------------------------- whole runs


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[str], int]:
    """Mooncake lines: conversations that extend earlier prompts' hash ids, prefixes of
    earlier prompts, ids reused after another prefix or at another length (a shorter
    last block)."""
    trace_block = draw(st.sampled_from([4, 8, 16]))
    lines = []
    histories: list[list[int]] = [[]]
    next_id = 100
    clock = 0
    for _ in range(draw(st.integers(1, 14))):
        base = list(draw(st.sampled_from(histories)))
        fresh = draw(st.integers(0 if base else 1, 4))
        ids = base + list(range(next_id, next_id + fresh))
        next_id += fresh
        if draw(st.booleans()):  # an id seen before, after another prefix: another block
            ids.append(draw(st.integers(100, next_id - 1)))
        if draw(st.booleans()) and len(ids) > 1:
            ids = ids[: draw(st.integers(1, len(ids)))]  # a prefix of an earlier prompt
        last = draw(st.integers(1, trace_block))
        input_length = (len(ids) - 1) * trace_block + last
        clock += draw(st.integers(0, 40))
        lines.append(
            json.dumps(
                {
                    "timestamp": clock,
                    "input_length": input_length,
                    "output_length": draw(st.integers(1, 3 * trace_block)),
                    "hash_ids": ids,
                }
            )
        )
        histories.append(ids)
    return lines, trace_block


@st.composite
def trace_configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([1, 2, 4, 3]))  # 3: blocks straddle hash ids
    return EngineConfig(
        num_gpu_blocks=draw(st.integers(12, 120)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(16, 96)),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["lifo", "fifo"])),
        enable_kv_cache_events=False,
    )


@asynccontextmanager
async def open_token_kv(config: EngineConfig, rank: int = 0) -> AsyncIterator[KvClient]:
    """`open_local_kv` with Dynamo's token hashes (the manager builds every token)."""
    yield LocalKvClient.create(
        config.num_gpu_blocks, config.block_size, enable_kv_cache_events=False
    )


async def _simulate(
    requests: list[RequestSpec], config: EngineConfig, *, tokens: bool | None, fast_forward: bool
) -> tuple[bytes, list[bytes]]:
    """The run's report (wall time left out) and records: ``tokens`` True with Dynamo's
    token hashes, False with run keys, None as `open_local_kv` has it for ``config``."""
    factory = open_token_kv if tokens else open_local_kv
    run = await run_simulation(requests, config, kv_factory=factory, fast_forward=fast_forward)
    keyed = [engine.kv for engine in run.engines]
    assert all(isinstance(kv, LocalKvClient) for kv in keyed)
    if tokens is not None:
        schemes = {kv.manager.run_keys for kv in keyed if isinstance(kv, LocalKvClient)}
        assert schemes == {not tokens}
    report = msgspec.structs.replace(run.report, wall_s=0.0, requests_per_wall_s=0.0)
    records = [msgspec.json.encode(r) for engine in run.engines for r in engine.stats.requests]
    return msgspec.json.encode(report), records


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), config=trace_configs(), fast_forward=st.booleans())
def test_run_keys_give_the_reports_token_hashes_give(
    trace: tuple[list[str], int], config: EngineConfig, fast_forward: bool
) -> None:
    lines, trace_block = trace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a TraceWarning for an id reused at another length
        requests = parse_mooncake_lines(lines, trace_block_size=trace_block)

    async def both() -> None:
        keyed = await _simulate(requests, config, tokens=False, fast_forward=fast_forward)
        hashed = await _simulate(requests, config, tokens=True, fast_forward=fast_forward)
        assert keyed == hashed
        # events on: Dynamo's hashes through the run memo, every token built for the events
        events_on = dataclasses.replace(config, enable_kv_cache_events=True)
        published = await _simulate(requests, events_on, tokens=None, fast_forward=fast_forward)
        assert published == keyed

    anyio.run(both)
