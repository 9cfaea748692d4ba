"""Throughput of kvpool.hashing and kvpool.events (hashing, codec, ZMQ publish).

Reproduce: python benchmarks/bench_events.py (needs pyzmq: kvpool[zmq]).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import xxhash
import zmq

from kvpool.events import BlockStored, KVEventBatch, ZmqEventPublisher, decode_batch, encode_batch
from kvpool.hashing import BlockHasher, block_hashes


def per_call(fn: Callable[[], object], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def naive(tokens: list[int], bs: int) -> list[int]:
    out: list[int] = []
    parent = None
    for i in range(0, len(tokens) - bs + 1, bs):
        data = b"".join(struct.pack("<I", t) for t in tokens[i : i + bs])
        local = xxhash.xxh3_64_intdigest(data, seed=1337)
        parent = (
            local
            if parent is None
            else xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
        )
        out.append(parent)
    return out


prompt = list(range(1000, 9192))  # 8192 tokens
t = per_call(lambda: block_hashes(prompt, 16), 200)
tn = per_call(lambda: naive(prompt, 16), 20)
print(
    f"block_hashes, 8192 tokens / block 16: {t * 1e6:8.1f} us/call "
    f"({len(prompt) / t / 1e6:5.1f} M tokens/s); per-token loop: {tn * 1e6:8.1f} us ({tn / t:.1f}x slower)"
)


def decode_steps() -> None:
    h = BlockHasher(16)
    h.extend(prompt[:512])
    for tok in range(1024):
        h.extend((tok,))


t = per_call(decode_steps, 20)
print(f"BlockHasher.extend, one token a call:  {t / 1025 * 1e9:8.0f} ns/call")

batch = KVEventBatch(
    ts=time.time(),
    events=[
        BlockStored(
            block_hashes=block_hashes(prompt[:512], 16),
            parent_block_hash=None,
            token_ids=prompt[:512],
            block_size=16,
        )
    ],
    data_parallel_rank=0,
)
payload = encode_batch(batch)
t = per_call(lambda: encode_batch(batch), 2000)
td = per_call(lambda: decode_batch(payload), 2000)
print(
    f"encode_batch, 32-block Stored ({len(payload)} B):  {t * 1e6:8.2f} us; decode {td * 1e6:.2f} us"
)

ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
with ZmqEventPublisher(
    endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx
) as pub:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    sub.rcvtimeo = 5000
    sub.linger = 0
    while not sub.poll(20):
        pub.publish(batch)
    sub.recv_multipart()
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        pub.publish(batch)
    t = (time.perf_counter() - start) / n
    got = 0
    while sub.poll(500):
        sub.recv_multipart()
        got += 1
    print(
        f"ZmqEventPublisher.publish, same batch:  {t * 1e6:8.2f} us/batch "
        f"({1 / t:,.0f} batches/s); loopback SUB received {got}/{n}"
    )
    sub.close()
ctx.destroy(linger=0)
