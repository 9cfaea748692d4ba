"""Write kvpool's shipped Mooncake-format sample trace, deterministically.

    python benchmarks/make_sample_trace.py > kvpool/data/sample_trace.jsonl

300 requests over about 40 s: new conversations open on one of a few shared system
prompts (1 to 4 blocks of 512 tokens), and conversations continue by extending their
whole earlier context with new blocks, as the hash ids of the published Mooncake traces
do (equal ids = equal blocks with equal prefixes). The last block of a prompt is partial.
A test regenerates the trace and compares it with the shipped file byte for byte.
"""

from __future__ import annotations

import json
import random
import sys

TRACE_BLOCK_SIZE = 512
NUM_REQUESTS = 300
MEAN_GAP_MS = 130.0
MAX_CONTEXT_BLOCKS = 14


def sample_trace_lines(seed: int = 2026) -> list[str]:
    """The trace's lines (JSON objects, keys in Mooncake's order), without newlines."""
    rng = random.Random(seed)
    next_id = 0

    def fresh_ids(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    system_prompts = [fresh_ids(rng.randint(1, 4)) for _ in range(5)]
    conversations: list[list[int]] = []
    lines = []
    timestamp = 0.0
    for _ in range(NUM_REQUESTS):
        timestamp += rng.expovariate(1.0 / MEAN_GAP_MS)
        open_ones = [c for c in conversations if len(c) < MAX_CONTEXT_BLOCKS]
        if open_ones and rng.random() < 0.55:
            context = rng.choice(open_ones)
            context.extend(fresh_ids(rng.randint(1, 2)))
        else:
            context = rng.choices(system_prompts, weights=[5, 3, 2, 1, 1])[0]
            context = context + fresh_ids(rng.randint(1, 3))
            conversations.append(context)
        input_length = (len(context) - 1) * TRACE_BLOCK_SIZE + rng.randint(1, TRACE_BLOCK_SIZE)
        record = {
            "timestamp": int(timestamp),
            "input_length": input_length,
            "output_length": rng.randint(8, 400),
            "hash_ids": list(context),
        }
        lines.append(json.dumps(record))
    return lines


def main() -> None:
    """Print the sample trace to stdout."""
    sys.stdout.write("".join(line + "\n" for line in sample_trace_lines()))


if __name__ == "__main__":
    main()
