"""aiconfigurator-core (NVIDIA's aiconfigurator, PyPI ``aiconfigurator-core``, the
``kvpool[aic]`` extra): a model's forward-pass latencies on a GPU system, predicted
offline from its measured kernel tables, for `AicTiming` and for planner-profile export.

`load_predictor` checks the model, system, backend and version against what the
installed package holds (so a typo is a one-line `AicConfigError` listing what exists,
and nothing is ever downloaded) and compiles aiconfigurator's engine for them (about
1.5 s, with the tables its queries read). `sample_profile` samples a compiled predictor
into a Dynamo planner profile (`ProfileTiming`), which `ProfileTiming.to_npz` writes:
the same timings for a user without aiconfigurator (kvpool's
``--planner-profile-data``, or Dynamo's mocker).

Imported only when asked for: ``import kvpool.engine`` does not load aiconfigurator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from kvpool.engine.timing import AIC_CONTEXT_BUCKET, AicTiming, LatencyPredictor, ProfileTiming
from kvpool.errors import InvalidArgumentError

AIC_DEFAULT_SYSTEM: Final = "h200_sxm"
AIC_DEFAULT_BACKEND: Final = "vllm"
AIC_DEFAULT_VERSION: Final = "current"
"""The database's newest maintained version of the backend on the system (its slot)."""
_VERSION_SLOTS = ("current", "previous", "next")
_INSTALL = "pip install 'kvpool[aic]'"


class AicConfigError(InvalidArgumentError):
    """A model, system, backend, version or parallelism aiconfigurator cannot predict
    (the message lists what the installed database holds)."""


@dataclass(frozen=True, slots=True)
class AicSpec:
    """What to predict: a model (a bundled Hugging Face id such as ``Qwen/Qwen3-8B``, or
    a local directory with a ``config.json``) served by ``backend`` at
    ``backend_version`` (a version, or a slot: current, previous, next) on ``tp_size``
    GPUs of ``system``, its KV cache in blocks of ``block_size`` tokens. A mixture of
    experts is split as vLLM splits it without expert parallelism (expert TP =
    ``tp_size``)."""

    model: str
    system: str = AIC_DEFAULT_SYSTEM
    backend: str = AIC_DEFAULT_BACKEND
    backend_version: str = AIC_DEFAULT_VERSION
    tp_size: int = 1
    block_size: int = 16


def require_aiconfigurator(flag: str = "--timing-model aic") -> Any:
    """The ``aiconfigurator_core`` module; ImportError naming the extra without it."""
    try:
        import aiconfigurator_core
    except ImportError:
        raise ImportError(f"{flag} needs aiconfigurator-core: {_INSTALL}") from None
    return aiconfigurator_core


def resolve_version(spec: AicSpec) -> str:
    """The literal database version ``spec`` names, after checking its model, system
    and backend exist; `AicConfigError` (one line, listing what exists) otherwise."""
    require_aiconfigurator()
    from aiconfigurator_core.sdk import common, perf_database

    model = spec.model
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise AicConfigError(f"--aic-model {model}: a directory with no config.json")
    elif model not in common.DefaultHFModels:
        raise AicConfigError(
            f"--aic-model {model}: not a local directory with a config.json nor a model "
            f"aiconfigurator bundles (it never downloads); bundled: "
            f"{', '.join(sorted(common.DefaultHFModels))}"
        )
    if type(spec.tp_size) is not int or spec.tp_size < 1:
        raise AicConfigError(f"--aic-tp-size must be an int >= 1, got {spec.tp_size!r}")
    slots = perf_database.get_version_slots(spec.system, spec.backend)
    if slots is None:  # the slow listing only to say what does exist
        databases = perf_database.get_supported_databases()
        if spec.system not in databases:
            raise AicConfigError(
                f"--aic-system {spec.system}: no performance data; systems: "
                f"{', '.join(sorted(databases))}"
            )
        raise AicConfigError(
            f"--aic-backend {spec.backend}: no performance data on {spec.system}; "
            f"backends there: {', '.join(sorted(databases[spec.system]))}"
        )
    version = spec.backend_version
    if version in _VERSION_SLOTS:
        if version not in slots:
            raise AicConfigError(
                f"--aic-backend-version {version}: {spec.backend} on {spec.system} has "
                f"no {version} version; versions: {_describe(slots)}"
            )
        return slots[version]
    if version not in slots.values():
        raise AicConfigError(
            f"--aic-backend-version {version}: not a version of {spec.backend} on "
            f"{spec.system}; versions: {_describe(slots)}"
        )
    return version


def _describe(slots: dict[str, str]) -> str:
    return ", ".join(f"{value} ({slot})" for slot, value in slots.items())


@contextmanager
def _quiet() -> Iterator[None]:
    """aiconfigurator logs a warning per low-fidelity table it loads: not the user's
    business in a one-line-error CLI (its predictions are what they are either way)."""
    logger = logging.getLogger("aiconfigurator_core")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_predictor(spec: AicSpec) -> tuple[LatencyPredictor, str]:
    """aiconfigurator's compiled engine for ``spec`` and the literal version it
    predicts for. Raises ImportError without the extra, `AicConfigError` for what the
    database does not hold or the model cannot be split so (nothing else happens)."""
    version = resolve_version(spec)
    from aiconfigurator_core.sdk.engine import EngineHandle

    try:
        with _quiet():
            handle = EngineHandle.compile(
                spec.model,
                spec.system,
                spec.backend,
                backend_version=version,
                tp_size=spec.tp_size,
                moe_tp_size=spec.tp_size,
                moe_ep_size=1,
                kv_block_size=spec.block_size,
            )
            # The first queries load the tables they read (about 0.3 s): here, with the
            # compilation, not in a simulation's first step.
            handle.predict_prefill_latency(1, 1024, 512)
            handle.predict_decode_latency(1, 1024, 2)
    except (ValueError, AssertionError, KeyError, NotImplementedError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise AicConfigError(
            f"aiconfigurator cannot model {spec.model} with {spec.backend} {version} on "
            f"{spec.tp_size} x {spec.system}: {detail}"
        ) from None
    predictor: LatencyPredictor = handle
    return predictor, version


def aic_timing(spec: AicSpec, context_bucket: int = AIC_CONTEXT_BUCKET) -> AicTiming:
    """`AicTiming` over `load_predictor`'s engine for ``spec``."""
    predictor, _ = load_predictor(spec)
    return AicTiming(predictor, context_bucket=context_bucket)


# ------------------------------------------------------------- planner profile

PROFILE_MAX_TOKENS: Final = 32768
"""Default top of the profile's prompt and context axes (past it: linear extrapolation)."""
PROFILE_MAX_KV_TOKENS: Final = 1 << 20
"""Default top of the profile's active-KV axis."""


def _axis(top: int) -> list[int]:
    """1, 2, 4, ... 64, then every 128 tokens to ``top``: fine where the fixed costs
    dominate, even where the curves are near linear."""
    points = [1 << i for i in range(7) if 1 << i < top]
    points += range(128, top + 1, 128)
    if points[-1] != top:
        points.append(top)
    return points


def _kv_axis(block_size: int, top: int) -> list[int]:
    """Active KV tokens: whole blocks about eight points an octave, from one block to
    ``top``."""
    points: list[int] = []
    x = float(block_size)
    while x < top:
        point = int(x) - int(x) % block_size
        if not points or point > points[-1]:
            points.append(point)
        x *= 2 ** (1 / 8)
    points.append(top)
    return points


def sample_profile(
    predictor: LatencyPredictor,
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_tokens: int = PROFILE_MAX_TOKENS,
    max_kv_tokens: int = PROFILE_MAX_KV_TOKENS,
) -> ProfileTiming:
    """A Dynamo planner profile sampled from ``predictor``, in the form `ProfileTiming`
    reads it:

    - ``prefill_ttft_ms[i]``: one request's prefill of ``prefill_isl[i]`` uncached
      tokens (the profile's prefill reads only the step's prompt tokens, T).
    - ``decode_itl[i][j]``: a decode pass at context ``decode_context_length[j]`` of
      the batch that fills ``decode_active_kv_tokens[i]`` KV tokens at that context:
      ``round(kv / context)`` requests, 1 to ``max_num_seqs``.

    The profile keeps what its axes can say: its prefill cannot tell a batch's cached
    prefix from its new tokens, and its decode reads the batch off the pool's active KV,
    which counts a block shared by several requests once. Stated tolerance of a
    simulation with the profile against one with `AicTiming` (checked by
    ``tests/engine/test_engine_aic.py`` on the embedded workload): simulated time, mean TTFT
    and mean ITL within 3% when no block is shared (prefix caching off); with shared
    prefixes simulated time within 1% and mean ITL within 10% (smaller batches seen),
    mean TTFT within 30% (it is mostly queueing, which amplifies the ITL's error).
    """
    for name, value, least in (
        ("block_size", block_size, 1),
        ("max_num_seqs", max_num_seqs, 1),
        ("max_tokens", max_tokens, 2),
        ("max_kv_tokens", max_kv_tokens, 2 * block_size),
    ):
        if type(value) is not int or value < least:
            raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    isl = _axis(max_tokens)
    context = _axis(max_tokens)
    kv = _kv_axis(block_size, max_kv_tokens)
    prefill = [float(predictor.predict_prefill_latency(1, n, 0)) for n in isl]
    itl = tuple(
        tuple(
            float(predictor.predict_decode_latency(min(max(round(k / c), 1), max_num_seqs), c, 2))
            for c in context
        )
        for k in kv
    )
    return ProfileTiming(
        tuple(float(x) for x in isl),
        tuple(prefill),
        tuple(float(x) for x in kv),
        tuple(float(x) for x in context),
        itl,
    )


__all__ = [
    "AIC_DEFAULT_BACKEND",
    "AIC_DEFAULT_SYSTEM",
    "AIC_DEFAULT_VERSION",
    "AicConfigError",
    "AicSpec",
    "aic_timing",
    "load_predictor",
    "require_aiconfigurator",
    "resolve_version",
    "sample_profile",
]
