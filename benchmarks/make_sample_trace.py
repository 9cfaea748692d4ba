"""Write kvpool's shipped Mooncake-format sample trace, deterministically.

    python benchmarks/make_sample_trace.py > kvpool/data/sample_trace.jsonl

300 requests over about 40 s: new conversations open on one of a few shared system
prompts (1 to 4 blocks of 512 tokens), and conversations continue by extending their
whole earlier context with new blocks, as the hash ids of the published Mooncake traces
do (equal ids = equal blocks with equal prefixes). The last block of a prompt is
usually partial, and a partial block gets an id of its own, used nowhere else: a
Mooncake id stands for one block of fixed content (aiperf's loader insists), so the
block a conversation later extends to 512 tokens is a new id there. A test regenerates
the trace and compares it with the shipped file byte for byte.
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
    # each conversation: the ids of the full blocks of its context so far, and how many
    # blocks (the last maybe partial) its latest request had
    conversations: list[tuple[list[int], list[int]]] = []
    lines = []
    timestamp = 0.0
    for _ in range(NUM_REQUESTS):
        timestamp += rng.expovariate(1.0 / MEAN_GAP_MS)
        open_ones = [c for c in conversations if c[1][0] < MAX_CONTEXT_BLOCKS]
        if open_ones and rng.random() < 0.55:
            full, blocks = rng.choice(open_ones)
            blocks[0] += rng.randint(1, 2)
        else:
            system = rng.choices(system_prompts, weights=[5, 3, 2, 1, 1])[0]
            full, blocks = list(system), [len(system) + rng.randint(1, 3)]
            conversations.append((full, blocks))
        tail = rng.randint(1, TRACE_BLOCK_SIZE)  # tokens in the last block
        num_full = blocks[0] - (tail < TRACE_BLOCK_SIZE)
        full.extend(fresh_ids(num_full - len(full)))
        record = {
            "timestamp": int(timestamp),
            "input_length": (blocks[0] - 1) * TRACE_BLOCK_SIZE + tail,
            "output_length": rng.randint(8, 400),
            "hash_ids": full[:num_full] + (fresh_ids(1) if tail < TRACE_BLOCK_SIZE else []),
        }
        lines.append(json.dumps(record))
    return lines


def main() -> None:
    """Print the sample trace to stdout."""
    sys.stdout.write("".join(line + "\n" for line in sample_trace_lines()))


if __name__ == "__main__":
    main()
