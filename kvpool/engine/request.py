"""A request as the engine's scheduler sees it: token counts, block count, timestamps."""

from __future__ import annotations

from kvpool.workloads import RequestSpec


class EngineRequest:
    """One admitted request's scheduling state.

    ``num_tokens`` counts the prompt plus every generated token; ``num_computed`` the
    tokens whose KV is computed (``<= num_tokens``); ``num_blocks`` the blocks its table
    holds, as the allocations reported them. Preemption resets ``num_computed`` and
    ``num_blocks`` to 0 and keeps the tokens. ``pending`` holds the newest generated
    tokens until the manager needs them (before an allocation, a watermark move or a
    preemption): a partial block has no hash, so the manager loses nothing by waiting.
    """

    __slots__ = (
        "arrival_s",
        "finish_s",
        "first_token_s",
        "num_blocks",
        "num_computed",
        "num_output",
        "num_preemptions",
        "num_tokens",
        "pending",
        "request_id",
        "spec",
    )

    def __init__(self, spec: RequestSpec, arrival_s: float) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.arrival_s = arrival_s
        self.num_tokens = spec.input_length
        self.num_computed = 0
        self.num_blocks = 0
        self.num_output = 0
        self.num_preemptions = 0
        self.pending: list[int] = []  # generated tokens the KV manager has not been told yet
        self.first_token_s: float | None = None
        self.finish_s: float | None = None

    def __repr__(self) -> str:
        return (
            f"EngineRequest({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, blocks={self.num_blocks}, output={self.num_output})"
        )
