"""The workload a profile-guided build of the compiled modules trains on (setup.py).

setup.py builds the compiled modules once instrumented (``-fprofile-generate``), runs
this script against that build, then builds them again from the recorded profile
(``-fprofile-use``): the C compiler lays out each function's hot paths together and
keeps cold code apart, which the interpreter-heavy code mypyc emits gains most from
(the CPU's instruction cache, not the instruction count, is what limits it). Code this
workload never runs is compiled as it would be without a profile
(``-fprofile-partial-training``), so a path missed here is not made slower.

What it runs, in a few seconds: the paths a simulation spends its time on. A
multi-turn Mooncake-format trace (each turn's prompt the session's history, over shared
system prompts) and the embedded default workload, through the manager inline and
through its actor, with KV events off (run keys) and on (token hashes), fast-forward on
and off; and the pool's per-block API. It checks nothing: the test suite does.

Run as ``python build_support/pgo_workload.py`` with the freshly built package first on
``sys.path``; it needs the package's runtime dependencies but not uvloop.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import anyio

from kvpool.engine import EngineConfig
from kvpool.engine.runner import KV_BACKENDS, run_simulation
from kvpool.pool import BlockPool
from kvpool.workloads import MooncakeTrace, RequestSpec, default_workload

TRACE_BLOCK = 512  # tokens per hash id, Mooncake's


def write_multiturn_trace(path: Path, sessions: int, rate: float, seed: int) -> None:
    """Chat sessions as Mooncake-format JSON lines: a turn's prompt is its session's
    history (a shared system prompt, the earlier turns and their answers), so turns
    share growing prefixes, as the multi-turn benchmark trace does; ``rate`` sessions
    start a second."""
    rng = random.Random(seed)
    next_id = 0
    systems = []
    for _ in range(8):
        systems.append(list(range(next_id, next_id + 4)))
        next_id += 4
    rows = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(rate)
        ids = list(rng.choice(systems))
        history = len(ids) * TRACE_BLOCK
        at = start
        for _ in range(rng.randint(1, 5)):
            prompt = history + rng.randint(50, 1500)
            while len(ids) < -(-prompt // TRACE_BLOCK):
                ids.append(next_id)
                next_id += 1
            output = rng.randint(20, 400)
            rows.append((int(at * 1000), prompt, output, list(ids)))
            history = prompt + output
            del ids[prompt // TRACE_BLOCK :]  # a partial block's id is not reused
            at += rng.expovariate(1 / 8.0)
    rows.sort(key=lambda row: row[0])
    with path.open("w") as out:
        for timestamp, prompt, output, hash_ids in rows:
            line = {
                "timestamp": timestamp,
                "input_length": prompt,
                "output_length": output,
                "hash_ids": hash_ids,
            }
            out.write(json.dumps(line) + "\n")


def simulate(
    requests: list[RequestSpec], blocks: int, backend: str, events: bool, fast_forward: bool
) -> None:
    config = EngineConfig(num_gpu_blocks=blocks, enable_kv_cache_events=events)

    async def run() -> None:
        await run_simulation(
            requests, config, kv_factory=KV_BACKENDS[backend], fast_forward=fast_forward
        )

    anyio.run(run)


def pool_calls(capacity: int, turns: int, seed: int) -> None:
    """The pool's per-block API as an engine without the manager drives it: admit a
    prompt on a shared prefix, cache its new blocks, release the table leaf first."""
    rng = random.Random(seed)
    pool = BlockPool(capacity)
    prefixes = [[rng.getrandbits(62) for _ in range(16)] for _ in range(8)]
    for _ in range(turns):
        hashes = rng.choice(prefixes) + [rng.getrandbits(62) for _ in range(rng.randint(1, 32))]
        admission = pool.admit(hashes, 1)
        if admission is None:
            continue
        fresh = admission.blocks[admission.cached : len(hashes)]
        pool.cache_many(list(zip(fresh, hashes[admission.cached :], strict=True)))
        pool.release_many(list(reversed(admission.blocks)))


def main() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "multiturn.jsonl"
        write_multiturn_trace(path, sessions=1500, rate=1.0, seed=1)
        with MooncakeTrace(path) as trace:
            multiturn = list(trace)
    chat = default_workload(0)
    for backend in ("local", "actor"):
        simulate(multiturn, 4096, backend, events=False, fast_forward=True)
        simulate(multiturn[:1000], 1024, backend, events=True, fast_forward=True)
        for events in (False, True):
            simulate(chat, 1024, backend, events, fast_forward=True)
    simulate(multiturn[:300], 512, "local", False, fast_forward=False)
    pool_calls(2048, 20_000, seed=2)
    print(f"{sys.argv[0]}: trained", file=sys.stderr)


if __name__ == "__main__":
    main()
