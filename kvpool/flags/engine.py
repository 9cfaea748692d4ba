"""The engine flags ``kvpool simulate`` and ``kvpool serve`` share, and the
`EngineConfig` they describe: one definition, so the two commands take the same engine.
"""

from __future__ import annotations

import argparse

from kvpool.engine import EngineConfig, TimingModel
from kvpool.engine.timing import (
    Dynamo16ProfileTiming,
    Dynamo16Timing,
    DynamoTiming,
    ProfileTiming,
    StepTiming,
)
from kvpool.errors import PoolError
from kvpool.flags.aic import add_aic_flags, aic_timing_from_flags, check_aic_flags
from kvpool.flags.values import int_at_least, number_at_most

_DEFAULTS = EngineConfig()
_MAX_POOL_BLOCKS = (1 << 32) - 1  # the pool's own limit
_MAX_TIMING = 1e6  # ms per step, us per token or per sequence: 1,000 s, 1 s, 1 s
_TIMING = TimingModel()


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags ``kvpool simulate`` and ``kvpool serve`` share (one definition,
    so the two commands take the same engine); `engine_config` reads them back."""
    engine = parser.add_argument_group("engine (per worker)")
    engine.add_argument(
        "--num-gpu-blocks",
        type=int_at_least(1, _MAX_POOL_BLOCKS),
        default=_DEFAULTS.num_gpu_blocks,
        metavar="N",
        help="KV-cache blocks in each worker's pool (default: %(default)s)",
    )
    engine.add_argument(
        "--block-size",
        type=int_at_least(1),
        default=_DEFAULTS.block_size,
        metavar="N",
        help="tokens per KV block (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int_at_least(1),
        default=_DEFAULTS.max_num_seqs,
        metavar="N",
        help="most requests running at once (default: %(default)s)",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(1),
        default=_DEFAULTS.max_num_batched_tokens,
        metavar="N",
        help="token budget of one step (default: %(default)s)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse cached prompt prefixes (default: on)",
    )
    engine.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_chunked_prefill,
        help="split long prompts across steps; off: a prompt is computed in one step or "
        "waits (default: on)",
    )
    engine.add_argument(
        "--preemption-mode",
        choices=("lifo", "fifo"),
        default=_DEFAULTS.preemption_mode,
        help="victim when blocks run out: newest running request (lifo, vLLM) or oldest "
        "(fifo) (default: %(default)s)",
    )
    # admission as vLLM 0.33's SchedulerConfig: the whole sequence must fit, and a watermark
    engine.add_argument(
        "--scheduler-reserve-full-isl",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.scheduler_reserve_full_isl,
        help="admit a waiting request only if the blocks of its whole prompt fit, not "
        "only its first chunk's (vLLM's; default: on)",
    )
    engine.add_argument(
        "--watermark",
        type=number_at_most(1.0),
        default=_DEFAULTS.watermark,
        metavar="FRACTION",
        help="fraction of the pool's blocks an admission must leave free while any "
        "request runs, in [0, 1) (vLLM's; default: %(default)s)",
    )
    engine.add_argument(
        "--step-overhead-ms",
        type=number_at_most(_MAX_TIMING),
        default=_TIMING.step_overhead_s * 1e3,
        metavar="MS",
        help="timing model: fixed cost of a step (default: %(default)s)",
    )
    engine.add_argument(
        "--prefill-us-per-token",
        type=number_at_most(_MAX_TIMING),
        default=_TIMING.prefill_token_s * 1e6,
        metavar="US",
        help="timing model: cost per prompt token computed (default: %(default)s)",
    )
    engine.add_argument(
        "--decode-us-per-seq",
        type=number_at_most(_MAX_TIMING),
        default=_TIMING.decode_seq_s * 1e6,
        metavar="US",
        help="timing model: cost per decoding sequence (default: %(default)s)",
    )
    engine.add_argument(
        "--timing-model",
        choices=("linear", "dynamo", "dynamo-1.6", "aic"),
        default="linear",
        help="step time: linear (the three flags above), dynamo (Dynamo mocker 1.4.0's "
        "default polynomial in the step's prompt tokens and KV usage; dynamo-1.6: as "
        "ai-dynamo-runtime 1.6.1 charges it) or aic (a real "
        "model's latencies on a real GPU, predicted by NVIDIA aiconfigurator's performance "
        "database, as Dynamo's mocker composes them; the --aic-* flags; needs pip install "
        "'kvpool[aic]') (default: %(default)s)",
    )
    engine.add_argument(
        "--planner-profile-data",
        metavar="FILE.npz",
        help="with --timing-model dynamo or dynamo-1.6: interpolate step times from a "
        "Dynamo planner profile (prefill_isl, prefill_ttft_ms, decode_active_kv_tokens, "
        "decode_context_length, decode_itl) instead of the polynomial (needs numpy)",
    )
    add_aic_flags(engine, int_at_least(1))


def _timing(args: argparse.Namespace) -> StepTiming:
    """The step-time model the flags choose (a planner profile is loaded here)."""
    if args.timing_model == "linear":
        return TimingModel(
            step_overhead_s=args.step_overhead_ms / 1e3,
            prefill_token_s=args.prefill_us_per_token / 1e6,
            decode_seq_s=args.decode_us_per_seq / 1e6,
        )
    if args.timing_model == "aic":
        return aic_timing_from_flags(args)
    release_16 = args.timing_model == "dynamo-1.6"
    if args.planner_profile_data is None:
        return Dynamo16Timing() if release_16 else DynamoTiming()
    profile = Dynamo16ProfileTiming if release_16 else ProfileTiming
    return profile.from_npz(args.planner_profile_data)


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """The `EngineConfig` the `add_engine_flags` flags describe.

    Exits through ``parser.error`` for flags that contradict each other; raises
    `PoolError` or ``ImportError`` for a planner profile that cannot be loaded.
    """
    if args.planner_profile_data is not None and args.timing_model not in ("dynamo", "dynamo-1.6"):
        parser.error("--planner-profile-data needs --timing-model dynamo")
    check_aic_flags(args, parser)
    timing = _timing(args)
    try:
        return EngineConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            # built only to be published: the report counts the batches either way
            enable_kv_cache_events=args.zmq_kv_event_port is not None,
            preemption_mode=args.preemption_mode,
            scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
            watermark=args.watermark,
            timing=timing,
        )
    except PoolError as exc:
        parser.error(str(exc))
