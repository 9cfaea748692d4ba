"""Throughput of kvpool.hashing and kvpool.events: hashing, the event codec, ZMQ publish.

Reproduce: ``python benchmarks/bench_events.py`` (needs pyzmq: ``pip install 'kvpool[zmq]'``).
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
    """Seconds per call of ``fn``, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def naive_block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The per-token loop kvpool.hashing replaces (same values)."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = b"".join(struct.pack("<I", t) for t in tokens[start : start + block_size])
        local = xxhash.xxh3_64_intdigest(data, seed=1337)
        if parent is not None:
            local = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=1337)
        parent = local
        out.append(local)
    return out


def bench_hashing(prompt: list[int]) -> None:
    fast = per_call(lambda: block_hashes(prompt, 16), 200)
    slow = per_call(lambda: naive_block_hashes(prompt, 16), 20)
    assert block_hashes(prompt, 16) == naive_block_hashes(prompt, 16)
    print(
        f"block_hashes, {len(prompt)} tokens, block 16: {fast * 1e6:.1f} us "
        f"({len(prompt) / fast / 1e6:.1f} M tokens/s); per-token loop {slow / fast:.1f}x slower"
    )

    def decode_steps() -> None:
        hasher = BlockHasher(16)
        hasher.extend(prompt[:512])
        for token in range(1024):
            hasher.extend((token,))

    print(f"BlockHasher.extend, one token a call: {per_call(decode_steps, 20) / 1025 * 1e9:.0f} ns")


def bench_codec_and_zmq(prompt: list[int]) -> None:
    stored = BlockStored(
        block_hashes=block_hashes(prompt[:512], 16),
        parent_block_hash=None,
        token_ids=prompt[:512],
        block_size=16,
    )
    batch = KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=0)
    payload = encode_batch(batch)
    encode = per_call(lambda: encode_batch(batch), 2000)
    decode = per_call(lambda: decode_batch(payload), 2000)
    print(
        f"32-block BlockStored batch ({len(payload)} B): encode {encode * 1e6:.2f} us, "
        f"decode {decode * 1e6:.2f} us"
    )

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with ZmqEventPublisher(endpoint="tcp://127.0.0.1:*", context=context) as publisher:
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.rcvtimeo = 5000
        subscriber.linger = 0
        subscriber.connect(publisher.endpoint)
        while not subscriber.poll(20):  # PUB drops frames until the subscription lands
            publisher.publish(batch)
        while subscriber.poll(100):
            subscriber.recv_multipart()
        count = 20_000
        start = time.perf_counter()
        for _ in range(count):
            publisher.publish(batch)
        seconds = (time.perf_counter() - start) / count
        received = 0
        while subscriber.poll(500):
            subscriber.recv_multipart()
            received += 1
        subscriber.close()
    context.term()
    print(
        f"ZmqEventPublisher.publish: {seconds * 1e6:.1f} us a batch "
        f"({1 / seconds:,.0f} batches/s); loopback SUB received {received}/{count}"
    )


def main() -> None:
    prompt = list(range(1000, 9192))
    bench_hashing(prompt)
    bench_codec_and_zmq(prompt)


if __name__ == "__main__":
    main()
