"""Token-block hashing: Dynamo's golden values and an independent xxhash derivation."""

from __future__ import annotations

import struct
from array import array
from itertools import pairwise

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvpool.errors import InvalidArgumentError, InvalidHashError
from kvpool.hashing import (
    BLOCK_HASH_SEED,
    BlockHasher,
    ChunkMemo,
    block_hashes,
    local_block_hash,
    local_block_hashes,
    sequence_hash,
)
from kvpool.hashing import block_hash as block_hash_module
from kvpool.hashing import memo as memo_module
from kvpool.hashing.block_hash import pack_tokens

# Dynamo's compute_block_hash_for_seq on tokens 0..31, block size 16 (see NOTES.md).
DYNAMO_GOLDEN_LOCAL = [15310707395893867146, 15292316782987903195]
# Sequence hashes of tokens 0..47, block size 16, chained as documented (pinned here so
# a change of chaining, packing or seed cannot pass unnoticed).
GOLDEN_SEQUENCE = [15310707395893867146, 13769157705258532664, 11879827756109914528]

U32_MAX = 2**32 - 1
tokens_st = st.lists(st.integers(0, U32_MAX), max_size=80)


def reference_local(block: list[int]) -> int:
    """Local hash straight from xxhash: tokens as little-endian u32, seed 1337."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=1337)


def reference_chain(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """Sequence hashes the long way: hash each block, then chain le_u64(parent)||le_u64(local)."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        local = reference_local(tokens[start : start + block_size])
        if parent is None:
            parent = local
        else:
            parent = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
        out.append(parent)
    return out


def test_seed_is_dynamos() -> None:
    assert BLOCK_HASH_SEED == 1337


def test_local_hashes_match_dynamo_golden_values() -> None:
    assert local_block_hashes(list(range(32)), 16) == DYNAMO_GOLDEN_LOCAL
    assert [local_block_hash(range(0, 16)), local_block_hash(range(16, 32))] == (
        DYNAMO_GOLDEN_LOCAL
    )


def test_first_block_sequence_hash_is_its_local_hash() -> None:
    assert block_hashes(list(range(32)), 16)[0] == DYNAMO_GOLDEN_LOCAL[0]
    assert sequence_hash(None, DYNAMO_GOLDEN_LOCAL[0]) == DYNAMO_GOLDEN_LOCAL[0]


def test_second_block_chains_parent_and_local_as_le_u64_pair() -> None:
    l0, l1 = DYNAMO_GOLDEN_LOCAL
    expected = xxhash.xxh3_64_intdigest(
        l0.to_bytes(8, "little") + l1.to_bytes(8, "little"), seed=1337
    )
    assert block_hashes(list(range(32)), 16) == [l0, expected]
    assert sequence_hash(l0, l1) == expected
    assert expected != l1  # the chain really changes the name of a non-first block


def test_sequence_hashes_match_the_pinned_golden_values() -> None:
    assert block_hashes(list(range(48)), 16) == GOLDEN_SEQUENCE
    hasher = BlockHasher(16)
    for token in range(48):  # fed one token at a time, as decode does
        hasher.extend([token])
    assert hasher.hashes == GOLDEN_SEQUENCE


def test_same_block_after_different_prefixes_gets_different_names() -> None:
    a = block_hashes([1] * 4 + [7] * 4, 4)
    b = block_hashes([2] * 4 + [7] * 4, 4)
    assert local_block_hash([7] * 4) == local_block_hashes([1] * 4 + [7] * 4, 4)[1]
    assert a[1] != b[1]


@given(tokens=tokens_st, block_size=st.integers(1, 17))
def test_block_hashes_equal_the_independent_derivation(tokens: list[int], block_size: int) -> None:
    assert block_hashes(tokens, block_size) == reference_chain(tokens, block_size)


@given(tokens=tokens_st, block_size=st.integers(1, 9), parent=st.integers(0, 2**64 - 1))
def test_parent_continues_a_chain(tokens: list[int], block_size: int, parent: int) -> None:
    assert block_hashes(tokens, block_size, parent) == reference_chain(tokens, block_size, parent)


def test_splitting_at_a_block_boundary_with_parent_equals_the_whole() -> None:
    tokens = list(range(100, 164))
    whole = block_hashes(tokens, 16)
    assert block_hashes(tokens[32:], 16, parent=whole[1]) == whole[2:]


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(list(range(47)), 16) == block_hashes(list(range(32)), 16)
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes(list(range(15)), 16) == []
    assert block_hashes([], 16) == []
    assert local_block_hashes(list(range(31)), 16) == DYNAMO_GOLDEN_LOCAL[:1]


def test_extreme_token_values_pack_as_u32() -> None:
    block = [0, U32_MAX, 1, 2**31]
    assert local_block_hash(block) == reference_local(block)


def test_bytes_input_means_token_ids_not_raw_bytes() -> None:
    assert block_hashes(bytes(range(8)), 4) == block_hashes(list(range(8)), 4)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.0], ["1"], [None], "abcd"])
def test_bad_tokens_raise_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        block_hashes(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        local_block_hash(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, None])
def test_bad_block_size_raises_invalid_argument(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        block_hashes([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        local_block_hashes([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        BlockHasher(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "0", True])
def test_bad_hashes_raise_invalid_hash(bad: object) -> None:
    with pytest.raises(InvalidHashError):
        block_hashes([1, 2], 1, parent=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashError):
        sequence_hash(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashError):
        sequence_hash(1, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashError):
        BlockHasher(4, parent=bad)  # type: ignore[arg-type]


def test_big_endian_hosts_byteswap_to_little_endian(monkeypatch: pytest.MonkeyPatch) -> None:
    u32 = array(block_hash_module.TOKEN_TYPECODE, [1, 2])
    native = block_hash_module.pack_tokens(u32)
    monkeypatch.setattr(block_hash_module, "_SWAP", True)
    # On this (little-endian) host the swap path must produce the opposite byte order.
    assert block_hash_module.pack_tokens([1, 2]) == struct.pack(">2I", 1, 2)
    assert block_hash_module.pack_tokens(u32) == struct.pack(">2I", 1, 2)
    assert list(u32) == [1, 2]  # the caller's array is not swapped in place
    assert native == struct.pack("<2I", 1, 2)


def test_u32_arrays_hash_like_lists_and_other_arrays_are_validated() -> None:
    tokens = list(range(40))
    u32 = array(block_hash_module.TOKEN_TYPECODE, tokens)
    assert block_hashes(u32, 16) == block_hashes(tokens, 16)
    assert block_hashes(array("q", tokens), 16) == block_hashes(tokens, 16)
    with pytest.raises(InvalidArgumentError):
        block_hashes(array("q", [1, -1]), 1)


@given(
    tokens=tokens_st,
    block_size=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    parent=st.none() | st.integers(0, 2**64 - 1),
)
def test_block_hasher_equals_hashing_everything_at_once(
    tokens: list[int], block_size: int, cuts: list[int], parent: int | None
) -> None:
    hasher = BlockHasher(block_size, parent=parent)
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    seen: list[int] = []
    for lo, hi in pairwise(bounds):
        new = hasher.extend(tokens[lo:hi])
        assert new == hasher.hashes[len(seen) :]  # exactly the blocks these tokens completed
        seen += new
        assert hasher.num_tokens == hi
        assert hasher.tail_len == hi % block_size
    assert hasher.hashes == seen == block_hashes(tokens, block_size, parent)


def test_block_hasher_one_token_at_a_time() -> None:
    hasher = BlockHasher(16)
    completed = [hasher.extend([t]) for t in range(32)]
    assert completed[15] == [DYNAMO_GOLDEN_LOCAL[0]]
    assert completed[31] == block_hashes(list(range(32)), 16)[1:]
    assert all(c == [] for i, c in enumerate(completed) if i not in (15, 31))
    assert hasher.block_size == 16
    assert hasher.parent is None


def test_block_hasher_bad_token_changes_nothing() -> None:
    hasher = BlockHasher(4)
    hasher.extend([1, 2, 3, 4, 5])
    before = (list(hasher.hashes), hasher.num_tokens, hasher.tail_len)
    with pytest.raises(InvalidArgumentError):
        hasher.extend([6, 7, -1, 8])
    assert (list(hasher.hashes), hasher.num_tokens, hasher.tail_len) == before
    assert hasher.extend([6, 7, 8]) == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]


@given(
    shared=st.lists(st.integers(0, U32_MAX), max_size=60),
    tails=st.lists(st.lists(st.integers(0, U32_MAX), max_size=30), min_size=1, max_size=5),
    block_size=st.integers(1, 5),
    chunk_blocks=st.integers(1, 4),
    max_entries=st.integers(1, 6),
    cuts=st.lists(st.integers(0, 90), max_size=4),
)
def test_hashers_sharing_a_memo_equal_hashing_everything_at_once(
    shared: list[int],
    tails: list[list[int]],
    block_size: int,
    chunk_blocks: int,
    max_entries: int,
    cuts: list[int],
) -> None:
    """Sequences that share a prefix, fed in pieces through one small memo (so entries
    are hit, missed and dropped), get exactly the hashes computed the long way."""
    memo = ChunkMemo(block_size, chunk_blocks=chunk_blocks, max_entries=max_entries)
    for tail in tails:
        tokens = shared + tail
        hasher = BlockHasher(block_size, memo=memo)
        bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
        for lo, hi in pairwise(bounds):
            hasher.extend(tokens[lo:hi])
        assert hasher.hashes == reference_chain(tokens, block_size)
        assert len(memo) <= max_entries


def test_a_repeated_prefix_is_looked_up_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = ChunkMemo(4, chunk_blocks=2)
    first = BlockHasher(4, memo=memo)
    first.extend(range(20))  # blocks 0-4: chunks [0, 2) and [2, 4), then block 4 alone
    assert len(memo) == 2
    hashed: list[int] = []
    real = memo_module.hash_packed_blocks

    def counting(packed: bytes | memoryview, block_size: int, parent: int | None) -> list[int]:
        hashed.append(len(packed) // (4 * block_size))
        return real(packed, block_size, parent)

    monkeypatch.setattr(memo_module, "hash_packed_blocks", counting)
    second = BlockHasher(4, memo=memo)
    second.extend(range(16))
    assert second.hashes == first.hashes[:4]
    assert hashed == []  # both chunks came from the memo
    second.extend([7, 7, 7, 7, 8, 8, 8, 8])  # block 4 then 5: chunk [4, 6) is new
    assert hashed == [2]
    assert second.hashes == reference_chain([*range(16), 7, 7, 7, 7, 8, 8, 8, 8], 4)


def test_a_memo_forgets_its_least_recently_used_chunk_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memo = ChunkMemo(1, chunk_blocks=2, max_entries=2)
    BlockHasher(1, memo=memo).extend([1, 2, 3, 4])  # remembers chunks A=[1, 2], B=[3, 4]
    BlockHasher(1, memo=memo).extend([1, 2, 5, 6])  # A again, then C: B, least recent, goes
    assert len(memo) == 2
    hashed: list[bytes] = []
    real = memo_module.hash_packed_blocks

    def counting(packed: bytes | memoryview, block_size: int, parent: int | None) -> list[int]:
        hashed.append(bytes(packed))
        return real(packed, block_size, parent)

    monkeypatch.setattr(memo_module, "hash_packed_blocks", counting)
    assert BlockHasher(1, memo=memo).extend([1, 2, 3, 4]) == reference_chain([1, 2, 3, 4], 1)
    assert hashed == [pack_tokens([3, 4])]  # A was remembered, B was not


@pytest.mark.parametrize(
    "kwargs",
    [{"chunk_blocks": 0}, {"max_entries": 0}, {"chunk_blocks": 1.0}, {"max_entries": True}],
)
def test_bad_memo_arguments_raise_invalid_argument(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        ChunkMemo(4, **kwargs)  # type: ignore[arg-type]


def test_a_memo_of_another_block_size_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="4-token blocks, not 8"):
        BlockHasher(8, memo=ChunkMemo(4))
