"""A caller cancelled *during* its own turn, as asyncio's Ctrl-C handler does it.

asyncio.Runner's SIGINT handler cancels the main task from a signal handler, which runs
between any two bytecodes: the future a caller awaits can turn cancelled while the actor
runs that caller's handler. The actor must then give the unread reply back and go on,
not crash on delivering it (found by tests/cli/test_cli.py's interrupted run).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvpool.actors import Handler, PoolState, open_pool

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the race is asyncio's: trio never cancels a parked task's wait


class Grab(msgspec.Struct, frozen=True, tag=True):
    """Admit one block, cancelling the caller's task mid-turn like a signal handler."""


async def test_a_caller_cancelled_mid_turn_gets_nothing_and_the_actor_lives() -> None:
    callers: list[asyncio.Task[Any]] = []
    states: list[PoolState] = []

    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)

        def grab(message: Grab) -> list[int]:
            callers[0].cancel()  # what Runner._on_sigint does to the main task
            admission = state.pool.admit([], 1)
            assert admission is not None
            return list(admission.blocks)

        def undo(message: Grab, blocks: list[int]) -> None:
            state.pool.release_many(blocks)

        return {Grab: Handler(grab, undo=undo)}

    async with open_pool(4, extensions=[extension]) as pool:
        task = asyncio.ensure_future(pool.call(Grab()))
        callers.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await pool.stats()  # the actor still serves
        assert stats.num_active == 0  # the unread reply's block was given back
        await pool.check_invariants()
