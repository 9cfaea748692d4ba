"""Ctrl-C on trio against a busy pool: one trial is one ``trio.run`` interrupted once.

The main task makes calls inside ``open_pool``'s block while helper tasks hammer the
same pool (leases with waiting admits, reservations, queries, shielded give-backs in
``finally``); a SIGINT then lands somewhere. The contract (`kvpool.actors`): the actor
settles (closed, or crashed), every call is answered (the run ends: no hang, no
TrioInternalError), the pool's own state stays consistent, and ``open_pool`` raises what
its body raised (KeyboardInterrupt, or the cancellation a helper's KeyboardInterrupt
caused), never an exception group of its own.

Used in-process by tests/actors/test_actor_interrupts.py (the signal raised from a trace
function at a chosen line) and as a script in a subprocess (real signals, at random
moments): ``python tests/support/interrupt_trials.py TRIALS SEED`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import trio

from kvpool.actors import Handler, PoolClient, PoolState, Status, open_pool
from kvpool.errors import PoolClosedError, PoolCrashedError

CAPACITY = 12


@dataclass
class Trial:
    """What one interrupted run left behind."""

    raised_by_open_pool: BaseException | None = None
    run_raised: BaseException | None = None
    states: list[PoolState] = field(default_factory=list)
    pool: PoolClient | None = None
    status: Status | None = None
    """The pool's actor's once the run is over (None if the body never got the pool):
    read by `run_trial` with SIGINT ignored, since an interrupt may land on any line of
    the scenario's own code, its ``finally`` blocks included."""
    rounds: int = 0
    left_normally: bool = False


def _capture(states: list[PoolState]) -> Callable[[PoolState], dict[type, Handler[Any, Any]]]:
    def extension(state: PoolState) -> dict[type, Handler[Any, Any]]:
        states.append(state)
        return {}

    return extension


async def _work(pool: PoolClient, rng: random.Random) -> None:
    """One round of every kind of call, give-backs in (shielded) ``finally`` blocks."""
    root = rng.randrange(3) * 100
    chain = [root + k for k in range(rng.randint(1, 4))]
    async with pool.lease(chain, rng.randint(0, 3), wait=True) as lease:
        fresh = lease.blocks[lease.admission.cached : len(chain)]
        if fresh:
            await pool.cache_many(list(zip(fresh, chain[lease.admission.cached :], strict=True)))
        await lease.free(1)
    async with pool.reservation([], rng.randint(1, 3)) as outcome:
        if outcome is not None:
            block = await pool.allocate_private(outcome.reservation)
            try:
                await pool.prefix_hit(root)
            finally:
                with trio.CancelScope(shield=True):
                    await pool.release(block)
    await pool.stats()


async def _helper(pool_box: list[PoolClient], ready: trio.Event, seed: int) -> None:
    await ready.wait()
    rng = random.Random(seed)
    with suppress(PoolClosedError, PoolCrashedError):
        while True:
            await _work(pool_box[0], rng)


async def _scenario(trial: Trial, seed: int, rounds: int | None) -> None:
    """Main task: open the pool, work ``rounds`` rounds (forever if None)."""
    rng = random.Random(seed)
    pool_box: list[PoolClient] = []
    ready = trio.Event()
    async with trio.open_nursery() as nursery:
        for k in range(3):
            nursery.start_soon(_helper, pool_box, ready, seed * 10 + k)
        try:
            async with open_pool(CAPACITY, extensions=[_capture(trial.states)]) as pool:
                trial.pool = pool
                pool_box.append(pool)
                ready.set()
                while rounds is None or trial.rounds < rounds:
                    await _work(pool, rng)
                    trial.rounds += 1
            trial.left_normally = True
        except BaseException as exc:
            trial.raised_by_open_pool = exc
            raise


def run_trial(
    seed: int, rounds: int | None, interrupt: Callable[[], Callable[[], None] | None]
) -> Trial:
    """One ``trio.run`` of the scenario, with trio's own Ctrl-C handler installed.

    ``interrupt`` runs first thing in the run; what it returns (if anything) is called
    once the run is over, with SIGINT ignored meanwhile, to stop any further signal.
    """
    trial = Trial()
    stop: list[Callable[[], None] | None] = [None]
    with default_sigint():
        try:
            trio.run(_start, trial, seed, rounds, interrupt, stop)
        except BaseException as exc:  # what reached the top: inspected by `check`
            trial.run_raised = exc
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late signal is dropped
            if stop[0] is not None:
                stop[0]()
            if trial.pool is not None:
                trial.status = trial.pool._actor.status
    return trial


async def _start(
    trial: Trial,
    seed: int,
    rounds: int | None,
    interrupt: Callable[[], Callable[[], None] | None],
    stop: list[Callable[[], None] | None],
) -> None:
    stop[0] = interrupt()
    await _scenario(trial, seed, rounds)


@contextmanager
def default_sigint() -> Iterator[None]:
    """Python's default SIGINT handler for the block (trio installs its own only over
    that one: a runner may have started us with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def check(trial: Trial) -> str:
    """The trial's outcome as one word, or raise AssertionError naming the breach."""
    if trial.run_raised is None:
        return "not interrupted"
    leaves = _leaves(trial.run_raised)
    assert all(isinstance(leaf, KeyboardInterrupt | trio.Cancelled) for leaf in leaves), (
        f"the run ended with {trial.run_raised!r}"
    )
    assert any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves), trial.run_raised
    if not trial.states:
        return "before the pool"
    raised = trial.raised_by_open_pool
    if raised is None:
        assert trial.left_normally
        assert trial.status is Status.CLOSED
        return "after the pool"
    assert isinstance(raised, KeyboardInterrupt | trio.Cancelled), (
        f"open_pool raised {raised!r}, not what its body raised"
    )
    if trial.status is None:
        return "entering open_pool"  # before it yielded the client: no actor to see
    assert trial.status in (Status.CLOSED, Status.CRASHED), trial.status
    (state,) = trial.states
    assert state.count_waiters() == 0, "a waiter was left unanswered"
    state.pool.check_invariants()
    return f"open_pool raised {type(raised).__name__}"


def _signal_later(delay: float) -> Callable[[], Callable[[], None]]:
    """Send this process a real SIGINT ``delay`` seconds after the run starts, then
    again every 20 ms until the run is over: Python drops a KeyboardInterrupt raised
    inside a weakref callback or a ``__del__`` (trio's handler cannot tell those
    frames apart), and a user whose first Ctrl-C vanished presses again."""

    def start() -> Callable[[], None]:
        pid = os.getpid()
        over = threading.Event()

        def press() -> None:
            if over.wait(delay):
                return
            for _ in range(500):
                os.kill(pid, signal.SIGINT)
                if over.wait(0.02):
                    return

        thread = threading.Thread(target=press, daemon=True)
        thread.start()

        def stop() -> None:
            over.set()
            thread.join()

        return stop

    return start


def main(trials: int, seed: int) -> None:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    for k in range(trials):
        trial = run_trial(seed * 1000 + k, None, _signal_later(rng.uniform(0.002, 0.05)))
        outcomes[check(trial)] += 1
    print(json.dumps({"seed": seed, "trials": trials, "outcomes": dict(outcomes)}))


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)  # a hang is a failure, not a wait
    main(int(sys.argv[1]), int(sys.argv[2]))
