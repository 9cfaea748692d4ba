"""The block pool by hand: cache a request's prefix, reuse it, and watch an eviction.

Run: python examples/pool_basics.py
"""

from __future__ import annotations

from kvpool.pool import BlockPool


def main() -> None:
    pool = BlockPool(4)

    # Request A: three full blocks, computed and cached, then finished (leaf first).
    chain = [101, 102, 103]
    outcome = pool.reserve([], len(chain))
    assert outcome is not None
    table = [pool.allocate_private(outcome.reservation) for _ in chain]
    for block_id, block_hash in zip(table, chain, strict=True):
        print(f"cache {block_hash}: newly visible = {pool.cache_private(block_id, block_hash)}")
    pool.cancel(outcome.reservation)
    for block_id in reversed(table):
        pool.release(block_id)
    print(f"A done: active={pool.num_active()} inactive={pool.num_inactive()}")

    # Request B shares A's first two blocks: look them up, then reserve them plus 2 new.
    prefix = [h for h in chain[:2] if pool.prefix_hit(h) is not None]
    outcome = pool.reserve(prefix, 2)
    assert outcome is not None
    print(f"B reserves prefix {prefix} + 2 fresh, evicting {outcome.removed}")
    table = pool.activate_prefix(outcome.reservation)
    table += [pool.allocate_private(outcome.reservation) for _ in range(2)]
    pool.cancel(outcome.reservation)
    print(f"B runs: active={pool.num_active()} refs={pool.num_active_refs()}")
    for block_id in reversed(table):
        pool.release(block_id)
    pool.check_invariants()
    print(f"B done: active={pool.num_active()} inactive={pool.num_inactive()}")


if __name__ == "__main__":
    main()
