"""``kvpool profile``: aiconfigurator's predicted step times written as a Dynamo
planner-profile NPZ, which ``kvpool simulate --timing-model dynamo
--planner-profile-data`` and Dynamo's mocker read without aiconfigurator."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpool.engine.config import EngineConfig
from kvpool.errors import PoolError
from kvpool.flags.aic import add_aic_flags, aic_spec
from kvpool.flags.values import int_at_least


def add_profile_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    positive = int_at_least(1)
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
