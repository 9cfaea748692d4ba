"""The engine over the pool actor: the same simulation as inline, one turn per step."""

from __future__ import annotations

import pytest

from kvpool.engine import EngineConfig, MockEngine
from kvpool.engine.runner import open_actor_kv, open_local_kv, run_simulation
from kvpool.errors import ManagerCrashedError, UnknownRequestError
from kvpool.events import EventCollector
from kvpool.manager import ManagerClient, StepUpdate
from kvpool.manager.messages import FinishStep
from kvpool.workloads import RequestSpec, Segment, SyntheticWorkload

pytestmark = pytest.mark.anyio

CONFIG = EngineConfig(num_gpu_blocks=192, max_num_batched_tokens=512)


async def test_actor_and_inline_managers_give_the_same_simulation() -> None:
    requests = SyntheticWorkload(seed=8, num_sessions=16).requests()
    reports = []
    streams = []
    for factory in (open_actor_kv, open_local_kv):
        sinks = [EventCollector(), EventCollector()]
        run = await run_simulation(requests, CONFIG, workers=2, kv_factory=factory, sinks=sinks)
        reports.append(run.report)
        streams.append([[b.events for b in sink.batches] for sink in sinks])
    actor, local = reports
    assert actor.total == local.total
    assert actor.workers == local.workers
    assert streams[0] == streams[1]  # the same events, batched the same way
    assert actor.total.preemptions > 0
    assert actor.total.evictions > 0
    assert actor.total.leaked_blocks == 0


async def test_the_actor_backend_is_the_managers_own_client() -> None:
    async with open_actor_kv(CONFIG) as kv:
        assert type(kv) is ManagerClient  # no adapter between the engine and the actor


async def test_a_step_runs_as_at_most_one_actor_turn() -> None:
    async with open_actor_kv(CONFIG) as kv:
        assert isinstance(kv, ManagerClient)
        engine = MockEngine(kv, CONFIG)
        prompt = (Segment(99, 40),)
        await engine.submit(RequestSpec("r", 0.0, prompt, Segment(5, 3)))
        turns = 0
        original = kv._call

        async def counting(message: object) -> object:
            nonlocal turns
            turns += isinstance(message, FinishStep)
            return await original(message)

        kv._call = counting
        steps = 0
        while engine.has_work:
            await engine.step()
            steps += 1
        # prefill, then two decodes: the first decode grows no table and fills no block,
        # so it has nothing to send and nothing to drain (no FinishStep); the second
        # finishes the request
        assert (steps, turns) == (3, 2)
        usage = await engine.final_usage()
        assert usage.num_active == 0


async def test_a_bad_step_batch_is_refused_and_changes_nothing() -> None:
    async with open_actor_kv(CONFIG) as kv:
        await kv.add_request("r", list(range(40)))
        assert await kv.allocate("r", 40) is not None
        before = await kv.usage()
        with pytest.raises(UnknownRequestError, match="ghost"):
            await kv.finish_step(
                [StepUpdate("r", [], 32, False), StepUpdate("ghost", [], -1, True)]
            )
        assert await kv.usage() == before
        assert await kv.take_events() == []  # "r" did not mark anything computed
        outcome = await kv.finish_step([StepUpdate("r", [], 32, True)])
        assert outcome.usage.num_active == 0
        assert len(outcome.events) == 1  # r's two full blocks, stored once computed


async def test_a_step_batch_failing_half_way_crashes_the_actor() -> None:
    async def drive() -> None:
        async with open_actor_kv(CONFIG) as kv:
            await kv.add_request("r", list(range(40)))
            await kv.allocate("r", 16)
            # the second update (40 computed in a 1-block table) is refused by the
            # manager after the first was applied: no clean refusal is possible
            batch = [StepUpdate("r", [7], -1, False), StepUpdate("r", [], 40, False)]
            with pytest.raises(ManagerCrashedError):
                await kv.finish_step(batch)

    with pytest.raises(ManagerCrashedError):  # and leaving the actor's block reports the crash
        await drive()
