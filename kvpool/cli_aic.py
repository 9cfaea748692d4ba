"""The command line's aiconfigurator parts: the ``--aic-*`` flags of ``--timing-model
aic`` (shared by ``kvpool simulate`` and ``kvpool serve``) and ``kvpool profile``, which
writes aiconfigurator's timings as a Dynamo planner profile. Everything here loads
aiconfigurator-core (the ``kvpool[aic]`` extra) only when a command asks for it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.engine.config import EngineConfig
from kvpool.engine.timing import AIC_CONTEXT_BUCKET, AicTiming
from kvpool.errors import PoolError

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


def add_profile_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    positive: Callable[[str], int],
) -> None:
    """``kvpool profile``: aiconfigurator's timings as a Dynamo planner-profile NPZ."""
    profile = commands.add_parser(
        "profile",
        help="write aiconfigurator's predicted step times as a Dynamo planner profile",
        description="Sample aiconfigurator's predicted prefill and decode latencies for a "
        "model on a GPU system into a Dynamo planner-profile NPZ (prefill_isl, "
        "prefill_ttft_ms, decode_active_kv_tokens, decode_context_length, decode_itl), "
        "which kvpool simulate --timing-model dynamo --planner-profile-data FILE and "
        "Dynamo's mocker read without aiconfigurator (needs the aic extra: pip install "
        "'kvpool[aic]'). Example: kvpool profile --aic-model Qwen/Qwen3-8B -o qwen3-8b.npz",
    )
    what = profile.add_argument_group("what to predict")
    add_aic_flags(what, positive, profile=True)
    what.add_argument(
        "--block-size",
        type=positive,
        default=EngineConfig().block_size,
        metavar="N",
        help="tokens per KV block (default: %(default)s)",
    )
    what.add_argument(
        "--max-num-seqs",
        type=positive,
        default=EngineConfig().max_num_seqs,
        metavar="N",
        help="largest decode batch sampled (default: %(default)s)",
    )
    profile.add_argument(
        "-o", "--output", required=True, metavar="FILE.npz", help="the profile to write"
    )
    profile.set_defaults(handler=_profile)


def _profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    def fail(message: str) -> int:
        print(f"kvpool profile: error: {message}", file=sys.stderr)
        return 1

    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():
        return fail(f"-o: cannot write {output}: not a file in an existing directory")
    try:
        from kvpool.engine.aic import load_predictor, require_aiconfigurator, sample_profile

        require_aiconfigurator("kvpool profile")
        require_numpy()
        spec = aic_spec(args)
        predictor, version = load_predictor(spec)
        profile = sample_profile(
            predictor, block_size=spec.block_size, max_num_seqs=args.max_num_seqs
        )
    except (ImportError, PoolError) as exc:
        return fail(str(exc))
    try:
        profile.to_npz(output)
    except OSError as exc:
        return fail(f"-o: cannot write {output}: {exc.strerror or exc}")
    print(
        f"kvpool profile: wrote {output}: {spec.model} on {spec.tp_size} x {spec.system}, "
        f"{spec.backend} {version}, {len(profile.prefill_isl)} prefill points, "
        f"{len(profile.decode_active_kv_tokens)} x {len(profile.decode_context_length)} "
        "decode points"
    )
    return 0


def require_numpy() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise ImportError("kvpool profile needs numpy: pip install 'kvpool[aic]'") from None
