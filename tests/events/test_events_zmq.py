"""ZmqEventPublisher against real ZMQ sockets on 127.0.0.1, decoded with vLLM's schema.

Every socket gets a receive timeout (the hang guard: a lost frame fails the test with
``zmq.Again`` instead of hanging) and ``linger=0``; each test's private context is
destroyed at teardown, closing anything left open.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import anyio
import anyio.to_thread
import msgspec
import pytest
import zmq
from test_events_wire import VllmKVEventBatch, vllm_decoder  # vLLM's schema, restated

from kvpool.errors import InvalidArgumentError
from kvpool.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    encode_batch,
)
from kvpool.events.codec import decode_array_batch
from kvpool.events.zmq_publisher import END_SEQ, llmd_topic, offset_endpoint_port

LOOPBACK = "tcp://127.0.0.1:*"  # ZMQ picks a free port; the publisher reports it
GUARD_MS = 5_000
PROBE_MS = 50
MAX_PROBES = 100


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def guarded(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.rcvtimeo = GUARD_MS
    sock.sndtimeo = GUARD_MS
    sock.linger = 0
    return sock


def step(n: int) -> KVEventBatch:
    """A batch as one scheduler step would publish it (rank left to the publisher)."""
    return KVEventBatch(
        ts=1000.0 + n,
        events=[
            BlockRemoved(block_hashes=[n]),
            BlockStored(
                block_hashes=[2 * n + 1, 2 * n + 2],
                parent_block_hash=None if n == 0 else 2 * n,
                token_ids=list(range(8)),
                block_size=4,
            ),
        ],
    )


def seq_of(frame: bytes) -> int:
    assert len(frame) == 8
    return int.from_bytes(frame, "big")


def subscribe_and_sync(
    pub: ZmqEventPublisher, sub: zmq.Socket[bytes], topic: bytes = b""
) -> list[list[bytes]]:
    """Connect ``sub`` and publish `step` batches until one arrives (PUB drops frames
    until the subscription reaches it); return the frames received so far."""
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    for _ in range(MAX_PROBES):
        pub.publish(step(pub.next_sequence))
        if sub.poll(PROBE_MS):
            return [sub.recv_multipart()]
    pytest.fail("the subscription never reached the publisher")


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    """vLLM's replay request from a DEALER: every ``[seq, payload]`` up to the end marker."""
    dealer = guarded(ctx, zmq.DEALER)
    dealer.ipv6 = True  # dual stack: reaches IPv4 and IPv6 endpoints alike
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        while True:
            # vLLM 0.33.0's four frames: delimiter, topic, seq, payload
            delimiter, topic, seq, payload = dealer.recv_multipart()
            assert delimiter == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return replies
            replies.append([seq, payload])
    finally:
        dealer.close()


def test_subscriber_decodes_vllm_frames_with_contiguous_sequence_from_zero(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with (
        ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub,
        guarded(ctx, zmq.SUB) as sub,
    ):
        live = subscribe_and_sync(pub, sub)
        for _ in range(10):
            pub.publish(step(pub.next_sequence))
        while len(live) < 11:  # the sync batch plus the ten after it
            live.append(sub.recv_multipart())
        total = pub.next_sequence

        for topic, seq, payload in live:
            assert topic == b""
            decoded = vllm_decoder.decode(payload)
            assert isinstance(decoded, VllmKVEventBatch)
            assert decoded.data_parallel_rank == 0
            assert payload == encode_batch(
                msgspec.structs.replace(step(seq_of(seq)), data_parallel_rank=0)
            )
        first = seq_of(live[0][1])
        assert [seq_of(f[1]) for f in live] == list(range(first, total))
        # Frames a slow-joining subscriber missed (sent before its subscription landed)
        # come back from replay, so the stream as a whole is contiguous from 0.
        replayed = replay(ctx, pub.replay_endpoint or "", 0)
        assert [seq_of(seq) for seq, _ in replayed] == list(range(total))
        assert [p for _, p in replayed[first:]] == [f[2] for f in live]


def test_replay_returns_buffered_batches_from_the_requested_sequence(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub:
        for n in range(6):
            pub.publish(step(n))
        endpoint = pub.replay_endpoint
        assert endpoint is not None
        from_two = replay(ctx, endpoint, 2)
        assert [seq_of(s) for s, _ in from_two] == [2, 3, 4, 5]
        for seq, payload in from_two:
            decoded = vllm_decoder.decode(payload)
            assert decoded.ts == step(seq_of(seq)).ts
            assert msgspec.structs.asdict(decoded.events[0])["block_hashes"] == [seq_of(seq)]
        assert replay(ctx, endpoint, 6) == []  # nothing that new yet: just the end marker
        assert len(replay(ctx, endpoint, 0)) == 6  # the same client may ask again


def test_replay_keeps_only_the_last_buffer_steps_batches(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with ZmqEventPublisher(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=3, context=ctx
    ) as pub:
        for n in range(5):
            pub.publish(step(n))
        assert [seq_of(s) for s, _ in replay(ctx, pub.replay_endpoint or "", 0)] == [2, 3, 4]


def test_a_replay_longer_than_zmqs_default_high_water_mark_arrives_whole(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """ROUTER drops what exceeds a peer's high-water mark (1000 by default) instead of
    blocking; the publisher raises it so a whole buffer fits even for a client that only
    starts reading once the replay was sent."""
    steps = 3_000
    big = KVEventBatch(
        ts=0.0, events=[BlockRemoved(block_hashes=list(range(1 << 20, (1 << 20) + 600)))]
    )
    with (
        ZmqEventPublisher(
            endpoint=LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=steps, context=ctx
        ) as pub,
        guarded(ctx, zmq.DEALER) as slow,
    ):
        for _ in range(steps):
            pub.publish(big)
        slow.rcvhwm = 10
        slow.connect(pub.replay_endpoint or "")
        slow.send_multipart([b"", (0).to_bytes(8, "big")])
        # Requests are served one at a time, in arrival order: once this later one is
        # answered, the slow client's replay has (normally) been sent while it read nothing.
        assert replay(ctx, pub.replay_endpoint or "", steps) == []
        received = 0
        while slow.recv_multipart()[2] != END_SEQ:
            received += 1
    assert received == steps


def test_req_socket_gets_the_first_replay_message(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A REQ client (its delimiter added by ZMQ) is served too, one message per request:
    REQ accepts a single reply, so whole replays need a DEALER."""
    with ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub:
        for n in range(3):
            pub.publish(step(n))
        for start, expected in [(1, 1), (3, None)]:
            with guarded(ctx, zmq.REQ) as req:
                req.connect(pub.replay_endpoint or "")
                req.send(start.to_bytes(8, "big"))
                topic, seq, payload = req.recv_multipart()
            assert topic == b""
            if expected is None:
                assert (seq, payload) == (END_SEQ, b"")
            else:
                assert seq_of(seq) == expected
                assert vllm_decoder.decode(payload).ts == step(expected).ts


def test_malformed_replay_request_is_ignored_and_service_continues(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub:
        pub.publish(step(0))
        with guarded(ctx, zmq.DEALER) as dealer:
            dealer.connect(pub.replay_endpoint or "")
            dealer.send_multipart([b"", b"one", b"too many"])
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            # The first reply answers the valid request: the bad one got nothing.
            _, _, seq, _ = dealer.recv_multipart()
            assert seq_of(seq) == 0
            assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]


def test_an_ipv6_endpoint_publishes(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with (
        ZmqEventPublisher(
            endpoint="tcp://[::1]:*", replay_endpoint="tcp://[::1]:*", context=ctx
        ) as pub,
        guarded(ctx, zmq.SUB) as sub,
    ):
        assert pub.endpoint.startswith("tcp://[::1]:")
        sub.ipv6 = True
        [(topic, seq, payload)] = subscribe_and_sync(pub, sub)
        assert topic == b""
        assert vllm_decoder.decode(payload).data_parallel_rank == 0
        replayed = replay(ctx, pub.replay_endpoint or "", seq_of(seq))
        assert [p for _, p in replayed] == [payload]


def test_topic_frame_and_rank_fill_in(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with (
        ZmqEventPublisher(
            data_parallel_rank=3, endpoint=LOOPBACK, topic="kv@rank3", context=ctx
        ) as pub,
        guarded(ctx, zmq.SUB) as sub,
    ):
        assert pub.data_parallel_rank == 3
        [topic, _, payload] = subscribe_and_sync(pub, sub, topic=b"kv@rank3")[0]
        assert topic == b"kv@rank3"
        assert vllm_decoder.decode(payload).data_parallel_rank == 3  # filled in
        pub.publish(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=7))
        assert vllm_decoder.decode(sub.recv_multipart()[2]).data_parallel_rank == 7  # kept


def test_connect_mode_reaches_a_bound_subscriber(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """An endpoint without a wildcard is connected to, as in vLLM."""
    with guarded(ctx, zmq.SUB) as sub:
        sub.bind(LOOPBACK)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        address = sub.get_string(zmq.LAST_ENDPOINT)
        with ZmqEventPublisher(endpoint=address, context=ctx) as pub:
            assert pub.endpoint == address
            for _ in range(MAX_PROBES):
                pub.publish(step(pub.next_sequence))
                if sub.poll(PROBE_MS):
                    break
            _, seq, payload = sub.recv_multipart()
            assert vllm_decoder.decode(payload).ts == step(seq_of(seq)).ts


def test_failed_publish_consumes_no_sequence_number(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub:
        pub.publish(step(0))
        too_big = KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[2**64])])
        with pytest.raises(OverflowError):
            pub.publish(too_big)
        assert pub.next_sequence == 1
        pub.publish(step(1))
        assert [seq_of(s) for s, _ in replay(ctx, pub.replay_endpoint or "", 0)] == [0, 1]


def test_closed_publisher_refuses_batches(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx)
    pub.publish(step(0))
    pub.close()
    assert pub.closed
    with pytest.raises(anyio.ClosedResourceError):
        pub.publish(step(1))
    assert pub.next_sequence == 1
    pub.close()  # idempotent


def test_endpoint_in_use_raises_and_leaves_nothing_open(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with ZmqEventPublisher(endpoint=LOOPBACK, context=ctx) as pub, pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(endpoint=pub.endpoint, bind=True, context=ctx)
    ctx.term()  # would hang if the failed constructor had left a socket open


@pytest.mark.parametrize(
    "kwargs",
    [
        {"data_parallel_rank": -1},
        {"buffer_steps": 0},
        {"hwm": -1},
        {"linger_ms": 1.5},
        {"topic": b"bytes"},
        {"endpoint": "ipc:///tmp/kv", "data_parallel_rank": 1},
        {"endpoint": ""},
        {"replay_endpoint": ""},
        {"endpoint": None},
    ],
)
def test_bad_arguments_raise_before_opening_anything(
    ctx: zmq.Context[zmq.Socket[bytes]], kwargs: dict[str, object]
) -> None:
    with pytest.raises(InvalidArgumentError):
        ZmqEventPublisher(context=ctx, **kwargs)  # type: ignore[arg-type]
    ctx.term()  # nothing was opened, so this returns


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://10.0.0.1:6000", 1, "tcp://10.0.0.1:6001"),
        ("tcp://[::1]:5557", 3, "tcp://[::1]:5560"),
        ("inproc://cache", 0, "inproc://cache"),
        ("inproc://cache", 4, "inproc://cache_dp4"),
        ("tcp://127.0.0.1:*", 5, "tcp://127.0.0.1:*"),
        (None, 3, None),
    ],
)
def test_endpoint_offset_by_rank_like_vllm(endpoint: str | None, rank: int, expected: str) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank"),
    [("tcp://*:70000", 0), ("tcp://*:65535", 1), ("tcp://127.0.0.1:65536", 0)],
)
def test_a_port_beyond_65535_is_refused_not_wrapped(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, rank: int
) -> None:
    # ZMQ would bind tcp://*:70000 to port 70000 - 65536 = 4464 without a word
    with pytest.raises(InvalidArgumentError, match="port"):
        offset_endpoint_port(endpoint, rank)
    with pytest.raises(InvalidArgumentError, match="port"):
        ZmqEventPublisher(rank, endpoint=endpoint, context=ctx)
    ctx.term()  # nothing was opened, so this returns


@pytest.mark.anyio
async def test_publish_from_async_code_and_aclose(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with anyio.fail_after(GUARD_MS / 1000):
        async with ZmqEventPublisher(
            endpoint=LOOPBACK, replay_endpoint=LOOPBACK, context=ctx
        ) as pub:
            for n in range(4):
                pub.publish(step(n))  # synchronous and non-blocking: fine on the loop
                await anyio.sleep(0)
            endpoint = pub.replay_endpoint or ""
            replies = await anyio.to_thread.run_sync(replay, ctx, endpoint, 0)
        assert pub.closed
    assert [seq_of(s) for s, _ in replies] == [0, 1, 2, 3]


def test_without_pyzmq_only_creating_a_publisher_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # makes `import zmq` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'kvpool\[zmq\]'"):
        ZmqEventPublisher(endpoint=LOOPBACK)


def test_kvpool_events_imports_without_pyzmq() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["zmq"] = None  # as if pyzmq were not installed
        from kvpool.events import EventCollector, KVEventBatch, ZmqEventPublisher, encode_batch
        sink = EventCollector()
        sink.publish(KVEventBatch(ts=1.0, events=[]))
        print(len(encode_batch(sink.batches[0])), ZmqEventPublisher.__name__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["12", "ZmqEventPublisher"]


def test_replay_carries_the_topic_frame_like_vllm_0_33(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Each replayed batch is ``[b"", topic, seq, payload]`` (four frames at a DEALER,
    what Dynamo's indexer expects); the end marker's topic frame is empty."""
    topic = llmd_topic("10.0.0.7", 8000, "kvpool-mock")
    assert topic == "kv@10.0.0.7:8000@kvpool-mock"
    with ZmqEventPublisher(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic=topic, context=ctx
    ) as pub:
        pub.publish(step(0))
        pub.publish(step(1))
        with guarded(ctx, zmq.DEALER) as dealer:
            dealer.connect(pub.replay_endpoint or "")
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            frames = dealer.recv_multipart()
            assert frames == [b"", topic.encode(), (1).to_bytes(8, "big"), frames[3]]
            assert vllm_decoder.decode(frames[3]).ts == step(1).ts
            assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]


def test_array_event_format_publishes_legacy_positional_events(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """``event_format="array"``: pre-#42892 payloads, live and replayed alike."""
    with ZmqEventPublisher(
        endpoint=LOOPBACK, replay_endpoint=LOOPBACK, event_format="array", context=ctx
    ) as pub:
        pub.publish(step(0))
        [(_, payload)] = replay(ctx, pub.replay_endpoint or "", 0)
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockRemoved"
    assert raw[1][1][:5] == ["BlockStored", [1, 2], None, list(range(8)), 4]
    assert decode_array_batch(payload) == msgspec.structs.replace(step(0), data_parallel_rank=0)


def test_unknown_event_format_is_rejected(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(InvalidArgumentError, match="event_format"):
        ZmqEventPublisher(endpoint=LOOPBACK, event_format="json", context=ctx)  # type: ignore[arg-type]
