"""Token-block hashing exactly as Dynamo's KV router does it (xxh3_64, seed 1337, chained).

See `kvpool.hashing.block_hash` for the exact byte layout of both hashes.
"""

from kvpool.hashing.block_hash import (
    BLOCK_HASH_SEED,
    TOKEN_TYPECODE,
    block_hashes,
    local_block_hash,
    local_block_hashes,
    sequence_hash,
)
from kvpool.hashing.hasher import BlockHasher
from kvpool.hashing.memo import ChunkMemo

__all__ = [
    "BLOCK_HASH_SEED",
    "BlockHasher",
    "ChunkMemo",
    "TOKEN_TYPECODE",
    "block_hashes",
    "local_block_hash",
    "local_block_hashes",
    "sequence_hash",
]
