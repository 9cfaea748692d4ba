"""A request's prompt as a router sees it: its length and its full blocks' hashes."""

from __future__ import annotations

from kvpool.hashing import block_hashes
from kvpool.workloads import RequestSpec


def prompt_hashes(request: RequestSpec, block_size: int) -> list[int]:
    """Dynamo's sequence hash of each full block of ``request``'s prompt (the tail that
    does not fill a block has none), as a router hashes the tokens it forwards."""
    return block_hashes(request.prompt_token_array(), block_size)
