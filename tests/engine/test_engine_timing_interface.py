"""The engine asks a timing model whether a run of decode steps has one step time
(`is_context_free`) instead of switching on its class: a model that says so is asked
once per jump, any other every step, and the results are the same either way."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from kvpool.engine import (
    Dynamo16Timing,
    DynamoTiming,
    EngineConfig,
    LocalKvClient,
    MockEngine,
    StepWork,
    TimingModel,
)
from kvpool.engine.timing import is_context_free
from kvpool.workloads import RequestSpec, Segment


@dataclass(frozen=True, slots=True)
class LinearPlusContext(TimingModel):
    """A subclass that reads the context: it must not inherit ``context_free``."""

    def duration(self, work: StepWork) -> float:
        return TimingModel.duration(self, work) + 1e-6 * work.context_tokens


@dataclass
class CountingTiming:
    """The linear model, counting how often it is asked, saying what it is told to."""

    context_free: bool
    calls: list[int] = field(default_factory=list)

    def duration(self, work: StepWork) -> float:
        self.calls.append(work.context_tokens)
        return TimingModel().duration(work)


def test_the_models_say_whether_they_read_the_context() -> None:
    assert is_context_free(TimingModel())
    assert is_context_free(DynamoTiming())
    assert not is_context_free(LinearPlusContext())
    assert not is_context_free(Dynamo16Timing())
    assert not is_context_free(CountingTiming(context_free=False))


def run(timing: CountingTiming) -> tuple[float, int]:
    """One request decoding 200 tokens, jumped over: the clock and the steps."""

    async def main() -> tuple[float, int]:
        config = EngineConfig(num_gpu_blocks=64, timing=timing)
        engine = MockEngine(LocalKvClient.create(64, config.block_size), config)
        await engine.submit(RequestSpec("r", 0.0, (Segment(11, 40),), Segment(12, 200)))
        while engine.has_work:
            if not await engine.fast_forward():
                await engine.step()
        return engine.clock, engine.stats.steps

    return anyio.run(main)


def test_a_context_free_model_is_asked_once_a_jump_with_the_same_result() -> None:
    free, varying = CountingTiming(context_free=True), CountingTiming(context_free=False)
    assert run(free) == run(varying)
    assert len(free.calls) < len(varying.calls)
