"""``--dispatch llm-d``: the llm-d inference scheduler's default scheduling profile.

llm-d's default ``EndpointPickerConfig`` (llm-d/llm-d-inference-scheduler, the
``default-plugins.yaml`` its charts install) scores every endpoint with three scorers of
the Gateway API inference extension and picks the highest weighted sum
(``max-score-picker``):

- ``prefix-cache-scorer``, weight 3: the fraction of the request's prompt blocks (at most
  ``maxPrefixBlocksToMatch``) found, from the first, in the endpoint's prefix index. The
  index is approximate, fed by the scheduler's own picks (every block of a request routed
  there becomes the most recent), an LRU of ``lruCapacityPerServer`` blocks per endpoint;
  no KV event is read.
- ``queue-scorer``, weight 2: ``(max - waiting) / (max - min)`` over the endpoints'
  waiting queues, 1 for all when they are equal.
- ``kv-cache-utilization-scorer``, weight 2: ``1 - kv_usage`` (active blocks over capacity).

Decisions: the plugin's defaults (``blockSize`` 64 tokens, ``maxPrefixBlocksToMatch`` 256,
``lruCapacityPerServer`` 31,250) are kept in tokens and converted to the engine's blocks,
which the index keys by Dynamo's sequence hashes (the plugin hashes its own 64-token
chunks; what matters, a chained prefix hash per block, is the same). Ties between top
scores are drawn from ``random.Random(seed)`` (the picker shuffles). ``--router-config``
takes ``{"weights": {"prefix-cache-scorer": 3, "queue-scorer": 2,
"kv-cache-utilization-scorer": 2}, "maxPrefixBlocksToMatch": 256, "lruCapacityPerServer":
31250, "blockSize": 64}``, any subset.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvpool.errors import InvalidArgumentError
from kvpool.events import KVEvent
from kvpool.routing.policy import RouterSettings, WorkerLoad
from kvpool.routing.prompt import prompt_hashes
from kvpool.routing.views import LruView
from kvpool.workloads import RequestSpec

PREFIX = "prefix-cache-scorer"
QUEUE = "queue-scorer"
KV_UTILIZATION = "kv-cache-utilization-scorer"
DEFAULT_WEIGHTS = {PREFIX: 3.0, QUEUE: 2.0, KV_UTILIZATION: 2.0}
"""llm-d's default profile: scorer name -> weight."""
_DEFAULTS = {"maxPrefixBlocksToMatch": 256, "lruCapacityPerServer": 31250, "blockSize": 64}


def _config(config: Mapping[str, object]) -> tuple[dict[str, float], dict[str, int]]:
    unknown = sorted(set(config) - {"weights", *_DEFAULTS})
    if unknown:
        raise InvalidArgumentError(f"--router-config: llm-d takes no {', '.join(unknown)}")
    weights = dict(DEFAULT_WEIGHTS)
    given = config.get("weights", {})
    if not isinstance(given, Mapping) or not set(given) <= set(DEFAULT_WEIGHTS):
        raise InvalidArgumentError(f"--router-config: weights names only {sorted(weights)}")
    for name, weight in given.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise InvalidArgumentError(f"--router-config: weight of {name} must be >= 0")
        weights[name] = float(weight)
    sizes = dict(_DEFAULTS)
    for name in _DEFAULTS:
        value = config.get(name, sizes[name])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"--router-config: {name} must be an int >= 1")
        sizes[name] = value
    return weights, sizes


class LlmdRouter:
    """llm-d's default scorers and weights (see the module docstring)."""

    uses_kv_events = False

    def __init__(self, settings: RouterSettings) -> None:
        self.weights, sizes = _config(settings.config)
        self.block_size = settings.block_size
        per_block = sizes["blockSize"] / self.block_size  # plugin chunks -> engine blocks
        self.max_blocks = max(1, int(sizes["maxPrefixBlocksToMatch"] * per_block))
        capacity = max(1, int(sizes["lruCapacityPerServer"] * per_block))
        self._views = [LruView(capacity) for _ in range(settings.num_workers)]
        self._random = random.Random(settings.seed)
        self._overlaps: dict[str, int] = {}

    def scores(self, hashes: Sequence[int], loads: Sequence[WorkerLoad]) -> list[float]:
        """Each worker's weighted score for a prompt of ``hashes`` (higher is better)."""
        weights = self.weights
        matched = hashes[: self.max_blocks]
        waiting = [load.num_waiting for load in loads]
        low, high = min(waiting), max(waiting)
        result = []
        for view, load in zip(self._views, loads, strict=True):
            prefix = view.overlap(matched) / len(matched) if matched else 0.0
            queue = 1.0 if high == low else (high - load.num_waiting) / (high - low)
            result.append(
                weights[PREFIX] * prefix
                + weights[QUEUE] * queue
                + weights[KV_UTILIZATION] * (1.0 - load.kv_usage)
            )
        return result

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        """The top score (ties drawn), its blocks then indexed on that worker."""
        hashes = prompt_hashes(request, self.block_size)
        scores = self.scores(hashes, loads)
        top = max(scores)
        best = [i for i, score in enumerate(scores) if score == top]
        index = best[0] if len(best) == 1 else best[self._random.randrange(len(best))]
        view = self._views[index]
        self._overlaps[request.request_id] = view.overlap(hashes)
        view.routed(hashes[: self.max_blocks])
        return index

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        """Nothing: the default prefix scorer reads no KV event."""

    def finished(self, worker: int, request_id: str, now: float) -> None:
        """Nothing: the scorers read the workers' metrics, not the router's counts."""

    def overlap_seen(self, request_id: str) -> int | None:
        """Blocks of the prompt the prefix index held on the chosen worker."""
        return self._overlaps.get(request_id)
