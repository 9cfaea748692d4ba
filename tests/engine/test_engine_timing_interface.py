"""The engine asks a timing model whether a run of decode steps has one step time
(`is_context_free`) and whether a growth can change it (`is_usage_free`) instead of
switching on its class: a model that says so is asked once per jump (and again at each
growth unless it reads no usage), any other every step, and the results are the same
either way."""

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
from kvpool.engine.timing import is_context_free, is_usage_free
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
    usage_free: bool = False
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


def test_the_models_say_whether_they_read_the_usage() -> None:
    assert is_usage_free(TimingModel())
    assert not is_usage_free(DynamoTiming())  # its decode time is a polynomial of usage
    assert not is_usage_free(LinearPlusContext())
    assert not is_usage_free(Dynamo16Timing())
    assert not is_usage_free(CountingTiming(context_free=True))


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


def test_a_usage_free_model_is_not_asked_again_when_a_table_grows() -> None:
    """200 decode steps cross 12 block boundaries: a model that reads the usage is asked
    again at each, one that does not only once per jump; the clock is the same."""
    free = CountingTiming(context_free=True, usage_free=True)
    reading = CountingTiming(context_free=True)
    assert run(free) == run(reading)
    assert len(free.calls) < len(reading.calls)
