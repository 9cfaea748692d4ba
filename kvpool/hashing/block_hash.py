"""Dynamo's token-block hashes: xxh3_64 (seed 1337) of tokens, chained into sequence hashes.

A KV-aware router names a block by the hash of its tokens *and* its whole prefix, and it
recomputes those names from the token ids it sees, so ours must be bit-identical to
Dynamo's (``ai-dynamo/dynamo``, ``lib/llm/src/kv_router/indexer.rs``: ``XXH3_SEED``,
``compute_hash``, ``compute_block_hash_for_seq``, ``compute_seq_hash_for_block``):

- local block hash of a full block of ``block_size`` tokens =
  ``xxh3_64(seed=1337)`` over the tokens as consecutive little-endian ``u32``
  (``4 * block_size`` bytes);
- sequence hash of the first block (no parent) = its local hash;
- sequence hash of any later block =
  ``xxh3_64(seed=1337)`` over the 16 bytes ``le_u64(parent sequence hash) ||
  le_u64(local hash)``.

Only full blocks are hashed; a partial tail is request-private and has no name.
Tokens are packed with ``array('I')`` in one C call (byte-swapped on big-endian hosts),
never token by token.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import cast

import xxhash

from kvpool.errors import InvalidArgumentError, InvalidHashError
from kvpool.pool import MAX_HASH

BLOCK_HASH_SEED = 1337
"""The xxh3_64 seed Dynamo uses for both local block hashes and the sequence chain."""

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_TOKEN_BYTES = 4


def _u32_typecode() -> str:
    for code in ("I", "L"):
        if array(code).itemsize == _TOKEN_BYTES:
            return code
    raise ImportError("kvpool.hashing needs a 4-byte unsigned array typecode")  # pragma: no cover


TOKEN_TYPECODE = _u32_typecode()
"""The ``array`` typecode of a ``u32``: how token ids are packed (and hashed)."""
_SWAP = sys.byteorder != "little"
_RAW_BYTES = (bytes, bytearray, memoryview)  # a tuple: isinstance is 2x faster than with a union


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Return ``tokens`` as consecutive little-endian ``u32`` bytes.

    Raises `InvalidArgumentError` if a token is not an int in ``[0, 2**32)``.
    """
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:
        packed = tokens  # already u32: nothing to validate
    else:
        if isinstance(tokens, _RAW_BYTES):
            tokens = list(tokens)  # array() would take these as raw bytes, not token ids
        try:
            packed = array(TOKEN_TYPECODE, tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidArgumentError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if _SWAP:
        packed = array(TOKEN_TYPECODE, packed)  # a copy: never swap the caller's array in place
        packed.byteswap()
    return packed.tobytes()


def check_block_size(block_size: object) -> None:
    """Raise `InvalidArgumentError` unless ``block_size`` is an ``int >= 1``."""
    if type(block_size) is not int or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")


def check_parent(parent: object) -> None:
    """Raise `InvalidHashError` unless ``parent`` is None or an int in ``[0, 2**64)``."""
    if parent is not None and (type(parent) is not int or not 0 <= parent <= MAX_HASH):
        raise InvalidHashError(f"parent hash must be None or an int in [0, 2**64), got {parent!r}")


def local_block_hash(tokens: Sequence[int]) -> int:
    """Return the local hash of one block: xxh3_64(seed 1337) of its tokens as LE ``u32``.

    Any length is hashed as given; callers pass exactly one full block.
    Raises `InvalidArgumentError` if a token is not an int in ``[0, 2**32)``.
    """
    return _xxh3(pack_tokens(tokens), BLOCK_HASH_SEED)


def sequence_hash(parent: object, local: object) -> int:
    """Return a block's sequence hash from its parent's sequence hash and its local hash.

    ``parent`` None (the first block) returns ``local`` itself; otherwise xxh3_64(seed
    1337) of ``le_u64(parent) || le_u64(local)``. Raises `InvalidHashError` if either
    is not an int in ``[0, 2**64)``.
    """
    check_parent(parent)
    if type(local) is not int or not 0 <= local <= MAX_HASH:
        raise InvalidHashError(f"local hash must be an int in [0, 2**64), got {local!r}")
    if parent is None:
        return local
    return _xxh3(_pack_pair(parent, local), BLOCK_HASH_SEED)


def hash_packed_blocks(
    packed: bytes | memoryview, block_size: int, parent: int | None
) -> list[int]:
    """Sequence hashes of every full block in LE-``u32`` bytes, chained from ``parent``.

    Unchecked fast path shared by `block_hashes` and `BlockHasher`: ``packed`` comes
    from `pack_tokens`, ``block_size`` and ``parent`` are already validated.
    """
    stride = block_size * _TOKEN_BYTES
    if len(packed) == stride:  # one block: a decode step filling it, the common case
        local = _xxh3(packed, BLOCK_HASH_SEED)
        return [local if parent is None else _xxh3(_pack_pair(parent, local), BLOCK_HASH_SEED)]
    view = memoryview(packed)
    hashes: list[int] = []
    append = hashes.append
    for start in range(0, len(view) - stride + 1, stride):
        local = _xxh3(view[start : start + stride], BLOCK_HASH_SEED)
        parent = local if parent is None else _xxh3(_pack_pair(parent, local), BLOCK_HASH_SEED)
        append(parent)
    return hashes


def local_block_hashes(tokens: Sequence[int], block_size: object) -> list[int]:
    """Return the local (unchained) hash of every full block, like Dynamo's
    ``compute_block_hash_for_seq``; the partial tail is ignored.

    Raises `InvalidArgumentError` for a bad ``block_size`` or token.
    """
    check_block_size(block_size)
    stride = cast(int, block_size) * _TOKEN_BYTES
    view = memoryview(pack_tokens(tokens))
    return [
        _xxh3(view[start : start + stride], BLOCK_HASH_SEED)
        for start in range(0, len(view) - stride + 1, stride)
    ]


def block_hashes(tokens: Sequence[int], block_size: object, parent: object = None) -> list[int]:
    """Return the sequence hash of every full block of ``tokens`` (partial tail ignored).

    ``parent`` is the sequence hash of the block just before ``tokens`` (None when they
    start the sequence). Raises `InvalidArgumentError` for a bad ``block_size`` or token,
    `InvalidHashError` for a bad ``parent``.
    """
    check_block_size(block_size)
    check_parent(parent)
    return hash_packed_blocks(
        pack_tokens(tokens), cast(int, block_size), cast("int | None", parent)
    )
