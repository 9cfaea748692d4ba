"""Which running requests a step schedules without a KV call, and which need one.

The engine's scheduling loop (`MockEngine._schedule`, which owns preemption and
admission because they await the KV client) calls these for every running request every
step; setup.py compiles this module with mypyc.
"""

from __future__ import annotations

from kvpool.engine.request import EngineRequest


def needs_call(request: EngineRequest, target: int, block_size: int, caching: bool) -> bool:
    """Whether scheduling ``request`` through ``target`` tokens needs the KV manager: its
    table must grow, or with prefix caching a block fills (it turns cache-visible at
    schedule time, as in vLLM)."""
    if -(-target // block_size) > request.num_blocks:
        return True
    return caching and target // block_size > request.num_computed // block_size


def schedule_fitting(
    running: list[EngineRequest],
    start: int,
    budget: int,
    scheduled: dict[EngineRequest, int],
    block_size: int,
    caching: bool,
) -> tuple[int, int]:
    """Schedule ``running[start:]`` in order while the budget lasts and each request's
    tokens fit its table without a KV call; return (the index of the first request that
    needs one, or ``len(running)``, and the budget left).
    """
    i = start
    count = len(running)
    while i < count and budget > 0:
        request = running[i]
        num_new = min(request.num_tokens - request.num_computed, budget)
        if needs_call(request, request.num_computed + num_new, block_size, caching):
            break
        scheduled[request] = num_new
        budget -= num_new
        i += 1
    return i, budget


def plan_slots(
    running: list[EngineRequest], start: int, budget: int, block_size: int, caching: bool
) -> tuple[list[tuple[int, int]], int]:
    """The requests from ``running[start]`` on that need a KV call this step if every
    allocation fits, as (index, tokens to allocate through), in order, and the budget
    left then: it is spent as `schedule_fitting` spends it, so those that fit are
    scheduled as planned (and the step's running requests all are, or none is left)."""
    plan: list[tuple[int, int]] = []
    i = start
    count = len(running)
    while i < count and budget > 0:
        request = running[i]
        num_new = min(request.num_tokens - request.num_computed, budget)
        target = request.num_computed + num_new
        if needs_call(request, target, block_size, caching):
            plan.append((i, target))
        budget -= num_new
        i += 1
    return plan, budget
