"""Step-time models: what a step did (`StepWork`) in, simulated seconds out.

The linear default (`TimingModel`), Dynamo
mocker 1.4.0's two models, read off its vLLM engine core: the *polynomial* default
(`DynamoTiming`) and the *interpolated* one built from a planner profile file
(`ProfileTiming`, ``--planner-profile-data``); and the mocker's third, aiconfigurator's
latency predictions (`AicTiming`, its ``--aic-perf-model``; the library is loaded by
`kvpool.engine.aic`). A Dynamo pass lasts prefill plus decode:

- prefill is charged only if some request computes prompt tokens in the step. Its
  input is T = n * (floor(sum(end) / n) - floor(sum(start) / n)) over the n requests
  that do, where start and end are the prompt tokens computed (a reused prefix
  included) before and after the step: Dynamo works from the batch's mean input length
  and mean prefix, each an integer. T is the step's prompt tokens, give or take the
  two floors (it can differ by less than n). Recomputed output tokens (a preempted
  request catching up) are not prompt tokens and cost nothing here, as in Dynamo.
- decode is charged only if some request samples a token in the step, at least 1 ms.
  Dynamo reads the pool's active blocks *after* the step's allocations (preemptions
  included) and before the sampled tokens need blocks of their own.

ai-dynamo-runtime 1.6.1 (the test extra's, whose offline replay
``benchmarks/bench_fidelity.py`` runs beside kvpool) charges prefill the same way but
decode differently (`Dynamo16Timing`, `Dynamo16ProfileTiming`; ``--timing-model
dynamo-1.6``): only if a request that had sampled before samples again in the step (it
decodes, or finishes recomputing after a preemption), so a step that only prefills
costs its prefill alone; and its KV usage is those requests' tokens over the pool's
tokens, at most 1, not the active blocks. Its offline replay loads no planner profile;
its ``fixed`` model is what a profile with flat tables gives here.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec

from kvpool.errors import InvalidArgumentError


class StepWork(msgspec.Struct, frozen=True, gc=False):
    """What one step computed, as the timing models read it.

    ``prefill_tokens``/``decode_seqs``: tokens computed outside decodes and sequences
    decoding one token (the linear model). ``prefill_requests``: requests computing
    prompt tokens; ``prompt_start``/``prompt_end``: their prompt tokens computed (cached
    prefix included) before and after the step, summed. ``emitting``: requests sampling
    a token; ``context_tokens``: their sequence lengths (prompt plus generated) summed;
    ``decoding``: those of them that had sampled a token before (decoding, or done
    recomputing after a preemption); ``decode_context_tokens``: their lengths summed.
    ``active_blocks``: the pool's active blocks after the step's allocations, of
    ``capacity`` blocks of ``block_size`` tokens. A msgspec Struct: the engine builds one
    per step, and a frozen dataclass costs several times as much to build.
    """

    prefill_tokens: int = 0
    decode_seqs: int = 0
    prefill_requests: int = 0
    prompt_start: int = 0
    prompt_end: int = 0
    emitting: int = 0
    context_tokens: int = 0
    decoding: int = 0
    decode_context_tokens: int = 0
    active_blocks: int = 0
    capacity: int = 1
    block_size: int = 16

    @property
    def dynamo_prompt_tokens(self) -> int:
        """Dynamo's T: batch size times (mean prompt end - mean prompt start), integer means."""
        n = self.prefill_requests
        if not n:
            return 0
        return n * (self.prompt_end // n - self.prompt_start // n)


class StepTiming(Protocol):
    """A step-time model: simulated seconds of a step that did ``work``."""

    def duration(self, work: StepWork) -> float:
        """Simulated seconds of the step (>= 0)."""
        ...


def is_context_free(timing: StepTiming) -> bool:
    """Whether ``timing`` gives every step of a run of pure decode steps the same time
    while the pool's usage stays put: it reads neither ``context_tokens`` nor
    ``decode_context_tokens``. A model says so with a ``context_free`` attribute that is
    True; one that does not (a custom model, say) is asked again every step of a jump,
    which is exact for any model, only slower.
    """
    return getattr(timing, "context_free", False) is True


def is_usage_free(timing: StepTiming) -> bool:
    """Whether ``timing`` reads nothing of the pool's usage (``active_blocks``,
    ``capacity``): a run of decode steps keeps its step time when a table grows. Said
    as `is_context_free` says its own, with a ``usage_free`` attribute that is True; a
    model that does not say so is asked again at every growth."""
    return getattr(timing, "usage_free", False) is True


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Simulated duration of one engine step; speed-of-light GPU costs, nothing more.

    ``step_time = step_overhead_s + prefill_token_s * prefill_tokens
    + decode_seq_s * decode_seqs``: a fixed launch/sampling cost per step, a cost per
    prompt token computed (prefill chunks and recomputation after preemption), and a cost
    per sequence decoding one token. The defaults are rough figures for an 8B model on
    one H100: 4 ms per step, ~16k prefill tokens/s, 60 us per decoding sequence.
    """

    step_overhead_s: float = 0.004
    prefill_token_s: float = 0.00006
    decode_seq_s: float = 0.00006

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "prefill_token_s", "decode_seq_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise InvalidArgumentError(f"{name} must be a number >= 0, got {value!r}")

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Simulated seconds of a step computing these prefill tokens and decode sequences."""
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
        )

    def duration(self, work: StepWork) -> float:
        """`step_time` of the step's prefill tokens and decoding sequences, its sum
        written out: the engine asks once a step or jump (22,500 times on the multi-turn
        trace), and a call of interpreted code costs more than the sum."""
        return (
            self.step_overhead_s
            + self.prefill_token_s * work.prefill_tokens
            + self.decode_seq_s * work.decode_seqs
        )

    @property
    def context_free(self) -> bool:
        """It reads no context (see `is_context_free`), unless a subclass's `duration` may."""
        return type(self).duration is TimingModel.duration

    @property
    def usage_free(self) -> bool:
        """It reads no usage (see `is_usage_free`), unless a subclass's `duration` may."""
        return type(self).duration is TimingModel.duration


@dataclass(frozen=True, slots=True)
class DynamoTiming:
    """Dynamo mocker 1.4.0's default ("polynomial") model, per step (ms):

    ``4.209989e-7*T^2 + 1.518344e-2*T + 16.50142`` if the step prefills, plus
    ``max(1, -25.74*p^2 + 54.01*p + 5.74)`` with p = active blocks / capacity if it
    samples a token.
    """

    def duration(self, work: StepWork) -> float:
        ms = 0.0
        if work.prefill_requests:
            ms += _dynamo_prefill_ms(work.dynamo_prompt_tokens)
        if work.emitting:
            ms += _dynamo_decode_ms(work.active_blocks / work.capacity)
        return ms / 1e3

    @property
    def context_free(self) -> bool:
        """It reads no context (see `is_context_free`), unless a subclass's `duration` may."""
        return type(self).duration is DynamoTiming.duration


def _dynamo_prefill_ms(t: int) -> float:
    """Dynamo's polynomial prefill milliseconds for T prompt tokens."""
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def _dynamo_decode_ms(p: float) -> float:
    """Dynamo's polynomial decode milliseconds at KV usage ``p``."""
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


@dataclass(frozen=True, slots=True)
class Dynamo16Timing:
    """ai-dynamo-runtime 1.6.1's polynomial model (the module docstring says how it
    differs from 1.4.0's `DynamoTiming`): prefill as there, plus the decode polynomial
    at p = min(1, decode_context_tokens / (capacity * block_size)) if some request
    decodes (``decoding``)."""

    def duration(self, work: StepWork) -> float:
        ms = 0.0
        if work.prefill_requests:
            ms += _dynamo_prefill_ms(work.dynamo_prompt_tokens)
        if work.decoding:
            p = min(1.0, work.decode_context_tokens / (work.capacity * work.block_size))
            ms += _dynamo_decode_ms(p)
        return ms / 1e3


class ProfileDataError(InvalidArgumentError):
    """A planner profile file that cannot be used: unreadable, or an array missing,
    misshapen, non-numeric, non-finite, or an axis not strictly increasing."""


@dataclass(frozen=True, slots=True)
class ProfileTiming:
    """Dynamo's interpolated model from a planner profile (``planner_profile_data``).

    Prefill (ms): ``prefill_ttft_ms`` over ``prefill_isl``, linear in T, at least 0.
    Decode (ms): ``decode_itl[i][j]`` over (``decode_active_kv_tokens[i]``,
    ``decode_context_length[j]``), bilinear in (active blocks * block size, the mean
    context length of the sampling requests, an integer), at least 1. Both extrapolate
    linearly from the nearest segment or cell beyond the grid, as Dynamo's
    ``ndarray_interp`` (``extrapolate(true)``) does.
    """

    prefill_isl: tuple[float, ...]
    prefill_ttft_ms: tuple[float, ...]
    decode_active_kv_tokens: tuple[float, ...]
    decode_context_length: tuple[float, ...]
    decode_itl: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_axis("prefill_isl", self.prefill_isl)
        _check_values("prefill_ttft_ms", self.prefill_ttft_ms, len(self.prefill_isl))
        _check_axis("decode_active_kv_tokens", self.decode_active_kv_tokens)
        _check_axis("decode_context_length", self.decode_context_length)
        if len(self.decode_itl) != len(self.decode_active_kv_tokens):
            raise ProfileDataError(
                f"decode_itl has {len(self.decode_itl)} rows; decode_active_kv_tokens "
                f"has {len(self.decode_active_kv_tokens)} points"
            )
        for row in self.decode_itl:
            _check_values("decode_itl row", row, len(self.decode_context_length))

    @classmethod
    def from_npz(cls, path: str | Path) -> ProfileTiming:
        """Load a planner profile ``.npz``. Needs numpy (``pip install kvpool[profile]``).

        Raises `ProfileDataError` for a file that cannot be used, `ImportError` without
        numpy.
        """
        try:
            import numpy as np
        except ImportError:
            raise ImportError(
                "--planner-profile-data needs numpy: pip install 'kvpool[profile]'"
            ) from None
        arrays: dict[str, Any] = {}
        try:
            with np.load(path, allow_pickle=False) as data:
                for name, ndim in _ARRAYS:
                    if name not in data.files:
                        raise ProfileDataError(f"{path}: no array {name!r} in the profile")
                    array = data[name]
                    if array.ndim != ndim:
                        raise ProfileDataError(
                            f"{path}: {name} must be {ndim}-D, it has shape {array.shape}"
                        )
                    if array.dtype.kind not in "iuf":
                        raise ProfileDataError(f"{path}: {name} is not numeric ({array.dtype})")
                    arrays[name] = array.astype(float).tolist()
        except ProfileDataError:
            raise
        except (OSError, ValueError, EOFError) as exc:  # zipfile.BadZipFile is an OSError
            raise ProfileDataError(f"{path}: not a readable .npz profile ({exc})") from None
        try:
            return cls(
                tuple(arrays["prefill_isl"]),
                tuple(arrays["prefill_ttft_ms"]),
                tuple(arrays["decode_active_kv_tokens"]),
                tuple(arrays["decode_context_length"]),
                tuple(tuple(row) for row in arrays["decode_itl"]),
            )
        except ProfileDataError as exc:
            raise ProfileDataError(f"{path}: {exc}") from None

    def to_npz(self, path: str | Path) -> None:
        """Write the profile as `from_npz` (and Dynamo's mocker) reads it: one float64
        array per field. Needs numpy; OSError if ``path`` cannot be written."""
        try:
            import numpy as np
        except ImportError:
            raise ImportError(
                "writing a planner profile needs numpy: pip install 'kvpool[profile]'"
            ) from None
        arrays: dict[str, Any] = {
            name: np.asarray(getattr(self, name), float) for name, _ in _ARRAYS
        }
        with open(path, "wb") as file:  # np.savez would append .npz to a name without it
            np.savez(file, **arrays)

    def prefill_ms(self, tokens: float) -> float:
        """Interpolated prefill milliseconds for ``tokens`` (not clamped)."""
        xs, ys = self.prefill_isl, self.prefill_ttft_ms
        i = _segment(xs, tokens)
        return ys[i] + (tokens - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])

    def decode_ms(self, active_kv_tokens: float, context_length: float) -> float:
        """Bilinearly interpolated decode milliseconds (not clamped)."""
        xs, ys, z = self.decode_active_kv_tokens, self.decode_context_length, self.decode_itl
        i, j = _segment(xs, active_kv_tokens), _segment(ys, context_length)
        tx = (active_kv_tokens - xs[i]) / (xs[i + 1] - xs[i])
        ty = (context_length - ys[j]) / (ys[j + 1] - ys[j])
        return (
            z[i][j] * (1 - tx) * (1 - ty)
            + z[i + 1][j] * tx * (1 - ty)
            + z[i][j + 1] * (1 - tx) * ty
            + z[i + 1][j + 1] * tx * ty
        )

    def duration(self, work: StepWork) -> float:
        ms = 0.0
        if work.prefill_requests:
            ms += max(0.0, self.prefill_ms(work.dynamo_prompt_tokens))
        if work.emitting:
            active_kv_tokens = work.active_blocks * work.block_size
            context_length = work.context_tokens // work.emitting
            ms += max(1.0, self.decode_ms(active_kv_tokens, context_length))
        return ms / 1e3


class Dynamo16ProfileTiming(ProfileTiming):
    """`ProfileTiming` charged as ai-dynamo-runtime 1.6.1 charges a step: decode only if
    some request decodes (``decoding``), interpolated at their tokens
    (``decode_context_tokens``) and their mean length. (1.6.1's offline replay loads no
    profile, so only its flat-table case, its ``fixed`` model, is checked against it.)"""

    __slots__ = ()

    def duration(self, work: StepWork) -> float:
        ms = 0.0
        if work.prefill_requests:
            ms += max(0.0, self.prefill_ms(work.dynamo_prompt_tokens))
        if work.decoding:
            context_length = work.decode_context_tokens // work.decoding
            ms += max(1.0, self.decode_ms(work.decode_context_tokens, context_length))
        return ms / 1e3


class LatencyPredictor(Protocol):
    """The two predictions `AicTiming` asks for, in milliseconds: aiconfigurator-core's
    ``EngineHandle`` (``aiconfigurator_core.sdk.engine``) and its ``AicEngine`` both
    have them. ``isl`` is the input length *including* the ``prefix`` already cached;
    ``osl=2`` is one decode step at context ``isl``."""

    def predict_prefill_latency(self, bs: int, isl: int, prefix: int = 0) -> float: ...

    def predict_decode_latency(self, bs: int, isl: int, osl: int = 2) -> float: ...


AIC_CONTEXT_BUCKET: Final = 64
"""`AicTiming`'s default decode context bucket (tokens); see `AicTiming`."""
AIC_EXACT_CONTEXT: Final = 256
"""Decode contexts below this many tokens are always asked exactly: there the predictions
are not monotone in the context (measured: a 1-3% wiggle over the first ~10 tokens)."""
_CACHE_LIMIT = 1 << 20
"""Entries a prediction cache keeps before it starts afresh (a bound on memory only)."""


class AicTiming:
    """Step times from aiconfigurator's performance database, composed as Dynamo's
    mocker composes them (``lib/mocker/src/common/perf_model.rs`` and its vLLM
    scheduler, ``--aic-perf-model``): a step lasts a prefill pass plus a decode pass.

    - Prefill, if n requests compute prompt tokens: ``predict_prefill_latency(n, isl,
      prefix)`` with ``isl = sum(end) // n`` and ``prefix = sum(start) // n``, the
      batch's integer mean prompt end and start (`StepWork`); 0 if ``isl == prefix``,
      never below 0.
    - Decode, if n requests sample a token: ``predict_decode_latency(n, sum(context) //
      n, 2)``, the mean sequence length of the sampling requests; at least 1 ms.

    Decision: the sum of two passes, as Dynamo does, and not aiconfigurator's own
    ``mixed_step_latency`` (one fused pass of prefill and decode tokens): kvpool times a
    step as the mocker it is compared with does, and the two paths then agree (a lone
    request's TTFT is its prefill latency plus one decode step in both).

    Caching (the database query costs 2-40 us, a kvpool step a few): prefill
    predictions are kept by their exact arguments. Decode predictions are kept by batch
    size and context bucket: with ``context_bucket`` W > 1, a context c >=
    `AIC_EXACT_CONTEXT` costs the linear interpolation between the exact predictions at
    the bucket's edges ``W * (c // W)`` and ``W * (c // W + 1)`` (exact at the edges).
    Measured against exact queries (Qwen3-8B, Qwen3-30B-A3B, gpt-oss-20b on h200_sxm,
    batch 1-256, contexts 256-33,000): at most 0.2% off with W = 64 (the default), 0.08%
    with W = 16; ``tests/engine/test_engine_aic.py`` checks the 0.5% bound this class states.
    W = 1 asks every context exactly (still cached).
    """

    __slots__ = ("_bucket", "_decode", "_decode_exact", "_predictor", "_prefill")

    def __init__(
        self, predictor: LatencyPredictor, *, context_bucket: int = AIC_CONTEXT_BUCKET
    ) -> None:
        if type(context_bucket) is not int or context_bucket < 1:
            raise InvalidArgumentError(
                f"context_bucket must be an int >= 1, got {context_bucket!r}"
            )
        self._predictor = predictor
        self._bucket = context_bucket
        self._prefill: dict[tuple[int, int, int], float] = {}
        self._decode: dict[tuple[int, int], tuple[float, float]] = {}  # bucket lines
        self._decode_exact: dict[tuple[int, int], float] = {}

    @property
    def context_bucket(self) -> int:
        return self._bucket

    def prefill_ms(self, batch: int, isl: int, prefix: int) -> float:
        """Milliseconds of a prefill pass of ``batch`` requests, each ``isl`` prompt
        tokens of which ``prefix`` were computed before (not clamped)."""
        key = (batch, isl, prefix)
        ms = self._prefill.get(key)
        if ms is None:
            if len(self._prefill) >= _CACHE_LIMIT:
                self._prefill.clear()
            ms = self._prefill[key] = float(
                self._predictor.predict_prefill_latency(batch, isl, prefix)
            )
        return ms

    def decode_ms(self, batch: int, context: int) -> float:
        """Milliseconds of a decode pass of ``batch`` requests at mean ``context``
        (bucketed as the class says; not clamped)."""
        width = self._bucket
        if width == 1 or context < AIC_EXACT_CONTEXT:
            key = (batch, context)
            ms = self._decode_exact.get(key)
            if ms is None:
                if len(self._decode_exact) >= _CACHE_LIMIT:
                    self._decode_exact.clear()
                predicted = self._predictor.predict_decode_latency(batch, context, 2)
                ms = self._decode_exact[key] = float(predicted)
            return ms
        start = context - context % width
        key = (batch, start)
        line = self._decode.get(key)
        if line is None:
            if len(self._decode) >= _CACHE_LIMIT:
                self._decode.clear()
            predict = self._predictor.predict_decode_latency
            base = float(predict(batch, start, 2))
            line = self._decode[key] = (
                base,
                (float(predict(batch, start + width, 2)) - base) / width,
            )
        return line[0] + line[1] * (context - start)

    def duration(self, work: StepWork) -> float:
        ms = 0.0
        n = work.prefill_requests
        if n:
            isl = work.prompt_end // n
            prefix = work.prompt_start // n
            if isl > prefix:
                ms += max(0.0, self.prefill_ms(n, isl, prefix))
        n = work.emitting
        if n:
            ms += max(1.0, self.decode_ms(n, work.context_tokens // n))
        return ms / 1e3


_ARRAYS = (
    ("prefill_isl", 1),
    ("prefill_ttft_ms", 1),
    ("decode_active_kv_tokens", 1),
    ("decode_context_length", 1),
    ("decode_itl", 2),
)


def _segment(xs: Sequence[float], x: float) -> int:
    """Index i of the segment [xs[i], xs[i+1]] that interpolates (or extrapolates) x."""
    return min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)


def _check_axis(name: str, values: Sequence[float]) -> None:
    _check_values(name, values, None)
    if len(values) < 2:
        raise ProfileDataError(f"{name} needs at least 2 points, it has {len(values)}")
    if any(b <= a for a, b in pairwise(values)):
        raise ProfileDataError(f"{name} must be strictly increasing")


def _check_values(name: str, values: Sequence[float], length: int | None) -> None:
    if length is not None and len(values) != length:
        raise ProfileDataError(f"{name} has {len(values)} values, expected {length}")
    for value in values:
        if type(value) is not float and type(value) is not int:
            raise ProfileDataError(f"{name} holds a non-number {value!r}")
        if not math.isfinite(value):
            raise ProfileDataError(f"{name} holds a non-finite value {value!r}")


__all__ = [
    "AIC_CONTEXT_BUCKET",
    "AicTiming",
    "Dynamo16ProfileTiming",
    "Dynamo16Timing",
    "DynamoTiming",
    "LatencyPredictor",
    "ProfileDataError",
    "ProfileTiming",
    "StepTiming",
    "StepWork",
]
