"""``--dispatch kv``: Dynamo's KV router (``KvRouter``, its ``DefaultWorkerSelector``).

The rule, per worker ``w`` (ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector.rs``,
``worker_logit``, as in ai-dynamo-runtime 1.6.1; the field names are its
``KvRouterConfig``'s):

    logit(w) = prefill_load_scale * max(0, prefill_tokens(w) / block_size
                                           - overlap_score_credit * overlap(w))
               + decode_blocks(w)

with ``prefill_tokens(w)`` = the prompt tokens of the requests this router sent to ``w``
whose prefill it has not seen end, plus this request's whole prompt, and
``decode_blocks(w)`` = the blocks of the requests it sent to ``w`` and has not seen
finish, plus this request's blocks (its prompt's, the partial tail counted as one), a
block that two of them share counted once (``router_assume_kv_reuse``). That is Dynamo's
documented ``overlap_score_weight * prefill_blocks + decode_blocks``: the older name
``overlap_score_weight`` sets ``prefill_load_scale``. The lowest logit wins; with
``router_temperature`` > 0 a worker is drawn with probability softmax(-logit / (range *
temperature)), logits rescaled by their range, as ``softmax_sample`` does.

Decisions, where kvpool cannot or need not copy Dynamo:

- Ties at temperature 0: Dynamo takes the first minimum in its hash map's order of worker
  ids, which real worker ids make arbitrary; here a tie is drawn uniformly from a
  ``random.Random(seed)``, so a run is the same for the same ``--seed``.
- Overlap: the request's leading block hashes found on the worker's `EventView` (built
  from its KV events, as Dynamo's indexer is), or with ``use_kv_events: false`` on a
  `PredictedView` of the router's own decisions kept ``router_ttl_secs`` (Dynamo's
  approximate mode).
- Prefill end: Dynamo marks it when the first token streams back; kvpool's routers see
  no tokens, so a request's prefill counts as ended when its worker publishes the
  BlockStored of its last full prompt block (a scheduler stores a block when it
  schedules its last token, so the last chunk's step), or when it finishes; a prompt
  whose full blocks were all cached has at most a block to compute and is not counted.
  Without events it ends with the request.
- ``router_track_active_blocks: false`` makes ``decode_blocks`` the request's own blocks
  only; ``router_track_prefill_tokens: false`` makes ``prefill_tokens`` the request's
  prompt only. Output blocks are not tracked (``router_track_output_blocks``'s default).
- Other KvRouterConfig fields: those that change nothing in one simulated router over
  GPU-only caches (`NO_EFFECT`: host and disk tier weights, replica sync, event threads,
  a remote indexer) are taken with any value; those kvpool does not model are taken at
  Dynamo's default only (`AT_DEFAULT`), so a config written for Dynamo runs as is; any
  other value, or an unknown name, is refused with its name.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.errors import InvalidArgumentError
from kvpool.events import BlockStored, KVEvent
from kvpool.routing.policy import RouterSettings, WorkerLoad
from kvpool.routing.prompt import prompt_hashes
from kvpool.routing.views import EventView, PredictedView
from kvpool.workloads import RequestSpec

NO_EFFECT = frozenset(
    {
        "host_cache_hit_weight",
        "disk_cache_hit_weight",
        "router_replica_sync",
        "router_event_threads",
        "use_remote_indexer",
        "serve_indexer",
        "conditional_disagg_policy",  # the conditional_disagg_* act only when it is enabled
        "conditional_disagg_eff_isl_threshold",
        "conditional_disagg_eff_isl_ratio_threshold",
        "conditional_disagg_prefill_busy_threshold",
        "conditional_disagg_decode_busy_threshold",
        "router_tracking_key_file",  # keyed tracking hashes: only with a keyed hash
        "router_tracking_key_id",
    }
)
"""KvRouterConfig fields with no effect here (one router, GPU-only caches): any value."""
AT_DEFAULT: dict[str, object] = {
    "router_track_output_blocks": False,
    "router_prefill_load_model": "none",
    "router_approximate_cache_policy": "ttl",
    "router_queue_threshold": None,
    "router_queue_policy": "fcfs",
    "enable_session_prefix_index": False,
    "shared_cache_multiplier": None,
    "shared_cache_type": "none",
    "router_predicted_ttl_secs": None,
    "conditional_disagg_enabled": False,
    "overlap_score_credit_decay": 0.0,
    "decode_active_request_weight": 0.0,
    "router_policy_config": None,
    "router_prefill_policy": None,
    "router_decode_policy": None,
    "router_tracking_hash": "public-xxh3-v1",
}
"""KvRouterConfig fields kvpool does not model, taken at ai-dynamo-runtime 1.6.1's
default only."""


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    """The Dynamo ``KvRouterConfig`` fields kvpool's KV router reads (Dynamo's defaults)."""

    prefill_load_scale: float = 1.0
    overlap_score_credit: float = 1.0
    router_temperature: float = 0.0
    use_kv_events: bool = True
    router_ttl_secs: float = 120.0
    router_track_active_blocks: bool = True
    router_track_prefill_tokens: bool = True
    router_assume_kv_reuse: bool = True

    @classmethod
    def from_mapping(cls, config: Mapping[str, object]) -> KvRouterConfig:
        """Parse ``--router-config``: Dynamo's field names; ``overlap_score_weight`` (its
        older name) sets ``prefill_load_scale``. Raises `InvalidArgumentError` for a
        field kvpool does not model or a value of the wrong type."""
        values: dict[str, object] = dict(config)
        if "overlap_score_weight" in values:
            weight = values.pop("overlap_score_weight")
            if weight is not None:
                values.setdefault("prefill_load_scale", weight)
        for name in [name for name in values if name in NO_EFFECT]:
            del values[name]
        for name in [name for name in values if name in AT_DEFAULT]:
            if values.pop(name) != AT_DEFAULT[name]:
                raise InvalidArgumentError(
                    f"--router-config: kvpool's kv router models {name} only at Dynamo's "
                    f"default, {AT_DEFAULT[name]!r}"
                )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidArgumentError(
                f"--router-config: kvpool's kv router does not model {', '.join(unknown)} "
                f"(it reads overlap_score_weight, {', '.join(sorted(known))})"
            )
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        parsed: dict[str, object] = {}
        for name, value in values.items():
            default = defaults[name]
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"--router-config: {name} must be true or false")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentError(f"--router-config: {name} must be a number")
            elif not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"--router-config: {name} must be >= 0")
            parsed[name] = value
        return cls(**parsed)  # type: ignore[arg-type]


class _Sent:
    """A request this router sent to a worker and has not seen finish."""

    __slots__ = ("blocks", "prefill_key", "prefill_tokens")

    def __init__(self, blocks: list[int], prefill_tokens: int, prefill_key: int | None) -> None:
        self.blocks = blocks  # its prompt's block hashes, tail block included (negative id)
        self.prefill_tokens = prefill_tokens  # 0 once its prefill is seen to end
        self.prefill_key = prefill_key  # the hash whose BlockStored ends its prefill


class _Worker:
    """The router's bookkeeping of one worker: what it sent there, block refcounts."""

    __slots__ = ("active", "pending", "prefill_tokens", "refs", "view")

    def __init__(self, view: EventView | PredictedView) -> None:
        self.view = view
        self.active: dict[str, _Sent] = {}
        self.refs: dict[int, int] = {}  # block -> how many active requests hold it
        self.prefill_tokens = 0
        self.pending: dict[int, list[str]] = {}  # prefill key -> requests waiting on it

    def end_prefill(self, sent: _Sent) -> None:
        self.prefill_tokens -= sent.prefill_tokens
        sent.prefill_tokens = 0


class KvRouter:
    """Dynamo's KV-aware router (see the module docstring for the rule and decisions)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.config = KvRouterConfig.from_mapping(settings.config)
        self.block_size = settings.block_size
        self.uses_kv_events = self.config.use_kv_events
        self._random = random.Random(settings.seed)
        ttl = self.config.router_ttl_secs
        self._workers = [
            _Worker(EventView() if self.uses_kv_events else PredictedView(ttl))
            for _ in range(settings.num_workers)
        ]
        self._overlaps: dict[str, int] = {}
        self._tail_ids = 0  # a private tail block's id: negative, never a hash

    def choose(self, request: RequestSpec, loads: Sequence[WorkerLoad], now: float) -> int:
        """The worker of lowest logit (or a softmax draw), recorded as sent there."""
        config = self.config
        block_size = self.block_size
        hashes = prompt_hashes(request, block_size)
        tokens = request.input_length
        tail = tokens % block_size != 0
        logits: list[float] = []
        overlaps: list[int] = []
        for worker in self._workers:
            view = worker.view
            overlap = (
                view.overlap(hashes) if isinstance(view, EventView) else view.overlap(hashes, now)
            )
            overlaps.append(overlap)
            prefill = tokens + (worker.prefill_tokens if config.router_track_prefill_tokens else 0)
            prefill_blocks = max(0.0, prefill / block_size - config.overlap_score_credit * overlap)
            own = len(hashes) + tail
            if config.router_track_active_blocks:
                refs = worker.refs
                if config.router_assume_kv_reuse:
                    own = sum(1 for h in hashes if h not in refs) + tail
                decode = len(refs) + own
            else:
                decode = own
            logits.append(config.prefill_load_scale * prefill_blocks + decode)
        index = self._pick(logits)
        self._send(index, request, hashes, tail, overlaps[index], now)
        return index

    def observe(self, worker: int, events: Sequence[KVEvent], now: float) -> None:
        """Index ``events`` on the worker's view; a stored prefill key ends a prefill."""
        state = self._workers[worker]
        view = state.view
        if not isinstance(view, EventView):
            return
        view.apply(events)
        pending = state.pending
        if not pending:
            return
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    waiting = pending.pop(block_hash, None)
                    for request_id in waiting or ():
                        sent = state.active.get(request_id)
                        if sent is not None:
                            state.end_prefill(sent)

    def finished(self, worker: int, request_id: str, now: float) -> None:
        """Forget the request: its prefill tokens and its blocks' references."""
        state = self._workers[worker]
        sent = state.active.pop(request_id, None)
        if sent is None:
            return
        state.end_prefill(sent)
        refs = state.refs
        for block in sent.blocks:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
        if sent.prefill_key is not None:
            waiting = state.pending.get(sent.prefill_key)
            if waiting is not None and request_id in waiting:
                waiting.remove(request_id)
                if not waiting:
                    del state.pending[sent.prefill_key]

    def overlap_seen(self, request_id: str) -> int | None:
        """Blocks of ``request_id``'s prompt the router saw on the worker it chose."""
        return self._overlaps.get(request_id)

    def _pick(self, logits: list[float]) -> int:
        temperature = self.config.router_temperature
        low = min(logits)
        if temperature == 0:
            best = [i for i, logit in enumerate(logits) if logit == low]
            return best[0] if len(best) == 1 else best[self._random.randrange(len(best))]
        high = max(logits)
        if low == high:
            weights = [1.0] * len(logits)
        else:
            scale = -1.0 / ((high - low) * temperature)
            weights = [math.exp((logit - low) * scale) for logit in logits]
        total = sum(weights)
        sample = self._random.random()
        cumulative = 0.0
        for i, weight in enumerate(weights):
            cumulative += weight / total
            if sample <= cumulative:
                return i
        return len(logits) - 1

    def _send(
        self,
        index: int,
        request: RequestSpec,
        hashes: list[int],
        tail: bool,
        overlap: int,
        now: float,
    ) -> None:
        state = self._workers[index]
        self._overlaps[request.request_id] = overlap
        blocks = list(hashes)
        if tail:
            self._tail_ids -= 1
            blocks.append(self._tail_ids)
        refs = state.refs
        for block in blocks:
            refs[block] = refs.get(block, 0) + 1
        view = state.view
        key: int | None = None
        prefill = 0
        if isinstance(view, PredictedView):
            view.routed(hashes, now)
            prefill = request.input_length - overlap * self.block_size
        elif overlap < len(hashes):  # full blocks to compute: its last one ends the prefill
            key = hashes[-1]
            prefill = request.input_length - overlap * self.block_size
            state.pending.setdefault(key, []).append(request.request_id)
        sent = _Sent(blocks, prefill, key)
        state.prefill_tokens += prefill
        state.active[request.request_id] = sent
