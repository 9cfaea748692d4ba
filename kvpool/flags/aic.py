"""The ``--aic-*`` flags naming what aiconfigurator predicts: ``--timing-model aic``'s
(shared by ``kvpool simulate`` and ``kvpool serve``) and ``kvpool profile``'s
(`kvpool.cli.profile`). Everything here loads aiconfigurator-core (the ``kvpool[aic]``
extra) only when a command asks for it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.engine.timing import AIC_CONTEXT_BUCKET, AicTiming

if TYPE_CHECKING:
    from kvpool.engine.aic import AicSpec

_DEFAULT_SYSTEM = "h200_sxm"  # kvpool.engine.aic's defaults, without importing it
_DEFAULT_BACKEND = "vllm"
_DEFAULT_VERSION = "current"
_FLAGS = ("aic_system", "aic_backend", "aic_backend_version", "aic_tp_size")


def add_aic_flags(
    group: argparse._ArgumentGroup, positive: Callable[[str], int], *, profile: bool = False
) -> None:
    """The flags naming what aiconfigurator predicts; `aic_spec` reads them back.
    ``positive`` parses an int >= 1 (the CLI's own parser, for the same messages)."""
    need = "" if profile else "with --timing-model aic: "
    group.add_argument(
        "--aic-model",
        required=profile,
        metavar="MODEL",
        help=f"{need}the model aiconfigurator predicts: a Hugging Face id it bundles "
        "(Qwen/Qwen3-8B, meta-llama/Meta-Llama-3.1-8B, openai/gpt-oss-20b, ...) or a local "
        "directory with a config.json; nothing is downloaded",
    )
    group.add_argument(
        "--aic-system",
        metavar="SYSTEM",
        help=f"GPU system of its performance database (default: {_DEFAULT_SYSTEM}; "
        "h100_sxm, b200_sxm, gb200, a100_sxm, l40s, ...)",
    )
    group.add_argument(
        "--aic-backend",
        metavar="NAME",
        help=f"serving framework measured: vllm, sglang or trtllm (default: {_DEFAULT_BACKEND})",
    )
    group.add_argument(
        "--aic-backend-version",
        metavar="VERSION",
        help="its version in the database, or a slot: current, previous, next (default: "
        "current, the database's newest maintained one)",
    )
    group.add_argument(
        "--aic-tp-size",
        type=positive,
        metavar="N",
        help="tensor-parallel GPUs per engine (default: 1)",
    )
    if not profile:
        group.add_argument(
            "--aic-context-bucket",
            type=positive,
            metavar="TOKENS",
            help="decode times at contexts of 256 tokens and more are interpolated "
            f"between predictions TOKENS apart (at most 0.5%% off; 1: every context "
            f"asked exactly) (default: {AIC_CONTEXT_BUCKET})",
        )


def check_aic_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit through ``parser.error`` if the aic flags and the timing model disagree."""
    given = [flag for flag in ("aic_model", *_FLAGS, "aic_context_bucket") if getattr(args, flag)]
    if args.timing_model == "aic":
        if args.aic_model is None:
            parser.error("--timing-model aic needs --aic-model")
    elif given:
        parser.error(f"--{given[0].replace('_', '-')} needs --timing-model aic")


def aic_spec(args: argparse.Namespace) -> AicSpec:
    """The `AicSpec` the flags name (``--block-size`` passed through)."""
    from kvpool.engine.aic import AicSpec

    return AicSpec(
        model=args.aic_model,
        system=args.aic_system or _DEFAULT_SYSTEM,
        backend=args.aic_backend or _DEFAULT_BACKEND,
        backend_version=args.aic_backend_version or _DEFAULT_VERSION,
        tp_size=args.aic_tp_size or 1,
        block_size=args.block_size,
    )


def aic_timing_from_flags(args: argparse.Namespace) -> AicTiming:
    """``--timing-model aic``'s `AicTiming`. Raises ImportError without the extra,
    `AicConfigError` (a `PoolError`) for what the database does not hold. Fills the
    defaults into ``args`` (the version as the literal a slot names), so the report's
    settings say what was predicted."""
    from kvpool.engine.aic import load_predictor, require_aiconfigurator

    require_aiconfigurator()
    spec = aic_spec(args)
    predictor, version = load_predictor(spec)
    bucket = args.aic_context_bucket or AIC_CONTEXT_BUCKET
    args.aic_system, args.aic_backend, args.aic_backend_version = spec.system, spec.backend, version
    args.aic_tp_size, args.aic_context_bucket = spec.tp_size, bucket
    return AicTiming(predictor, context_bucket=bucket)
