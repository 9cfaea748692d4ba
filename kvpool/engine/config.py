"""The mock engine's knobs, named after vLLM's and the mockers' flags; its step-time
models, the linear default (`TimingModel`) included, are in `kvpool.engine.timing`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpool.engine.timing import StepTiming, TimingModel
from kvpool.errors import InvalidArgumentError

PreemptionMode = Literal["lifo", "fifo"]
"""Which running request is preempted when a block is short: newest (vLLM) or oldest."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine's scheduler and cache configuration (vLLM v1 names).

    ``enable_kv_cache_events`` (vLLM's ``KVEventsConfig`` switch) builds the KV events an
    event sink publishes; off, nothing is built and the report is the same (the batches
    are counted all the same): `kvpool simulate` turns it on only when it publishes.

    Admission of a waiting (or preempted) request is vLLM 0.33's
    (``KVCacheManager.allocate_slots``): with ``scheduler_reserve_full_isl`` (vLLM's
    default) the blocks of its *whole* sequence must fit, not only this step's chunk;
    ``watermark`` (a fraction of ``num_gpu_blocks``, rounded down to whole blocks, as
    vLLM's ``watermark_blocks``) must stay free besides, whenever some request is
    running. `MockEngine` states the rule once, where it applies it.

    ``max_model_len`` (vLLM's; None: no limit but the pool's) is the most tokens a
    request may hold, prompt plus output: a longer one is rejected when submitted, as
    vLLM's server refuses a prompt plus ``max_tokens`` beyond it.
    """

    num_gpu_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_kv_cache_events: bool = True
    preemption_mode: PreemptionMode = "lifo"
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    timing: StepTiming = field(default_factory=TimingModel)
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (
            type(self.max_model_len) is not int or self.max_model_len < 1
        ):
            raise InvalidArgumentError(
                f"max_model_len must be an int >= 1 or None, got {self.max_model_len!r}"
            )
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if self.preemption_mode not in ("lifo", "fifo"):
            raise InvalidArgumentError(
                f"preemption_mode must be 'lifo' or 'fifo', got {self.preemption_mode!r}"
            )
        watermark = self.watermark
        if type(watermark) not in (int, float) or not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be a number in [0, 1), got {watermark!r}")
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enable_kv_cache_events",
            "scheduler_reserve_full_isl",
        ):
            if type(getattr(self, name)) is not bool:
                raise InvalidArgumentError(f"{name} must be a bool")
        if not callable(getattr(self.timing, "duration", None)):
            raise InvalidArgumentError(f"timing must be a step-time model, got {self.timing!r}")

    @property
    def watermark_blocks(self) -> int:
        """The free blocks an admission must leave (vLLM's ``int(watermark * num_blocks)``)."""
        return int(self.watermark * self.num_gpu_blocks)
