"""Hash tokens like Dynamo's router, emit vLLM-format KV events, replay them over ZMQ.

Run: python examples/events_and_hashing.py   (the ZMQ part needs pyzmq: kvpool[zmq])
"""

from __future__ import annotations

import anyio

from kvpool.events import EventStream, ZmqEventPublisher, decode_batch, encode_batch
from kvpool.hashing import BlockHasher, block_hashes
from kvpool.manager import KvManager
from kvpool.pool import BlockPool


def main() -> None:
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)  # full blocks only: the 8-token tail is private
    hasher = BlockHasher(16)
    assert hasher.extend(tokens[:20]) + hasher.extend(tokens[20:]) == hashes
    print(f"sequence hashes: {hashes}")

    manager = KvManager(BlockPool(8), block_size=16)
    manager.add_request("r1", tokens)
    assert manager.allocate("r1", len(tokens)) is not None
    manager.mark_computed("r1", len(tokens))
    batch = manager.take_batch(ts=1.0, data_parallel_rank=0)
    assert batch is not None
    assert decode_batch(encode_batch(batch)) == batch
    print(f"events: {[type(event).__name__ for event in batch.events]}")

    async def subscribe() -> None:
        stream = EventStream()
        async with stream.subscribe() as events:
            stream.publish(batch)
            stream.close()
            async for received in events:
                print(f"subscriber got {len(received.events)} event(s)")

    anyio.run(subscribe)

    import zmq

    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
    ) as publisher:
        publisher.publish(batch)  # replayed as [b"", topic, sequence (8 bytes), payload]
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # replay from sequence 0
        _, _topic, sequence, payload = dealer.recv_multipart()  # vLLM 0.33.0: 4 frames
        print(
            f"replayed sequence {int.from_bytes(sequence, 'big')}: {decode_batch(payload) == batch}"
        )
        dealer.close(linger=0)


if __name__ == "__main__":
    main()
