"""vLLM's ZMQ KV-event publisher: PUB frames ``[topic, seq, payload]`` plus replay ROUTER.

Wire protocol (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

- every batch is one multipart message on a PUB socket:
  ``[topic, seq.to_bytes(8, "big"), msgpack(KVEventBatch)]``; ``topic`` defaults to
  ``b""`` and ``seq`` counts batches from 0 with no gaps;
- with a replay endpoint, a ROUTER socket answers a request whose last frame is an
  8-byte big-endian start sequence number (``[b"", start]`` from a DEALER, or just
  ``start`` from a REQ, which adds the empty delimiter itself): it sends one message
  ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start``, oldest first,
  then the end marker ``[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]`` (its
  topic frame is empty whatever the topic). A DEALER thus receives four frames,
  ``[b"", topic, seq, payload]``: vLLM 0.33.0's framing, which Dynamo's indexer
  checks (with three it logs "Unexpected replay frame count: 3" and cannot fill a gap).
  A REQ socket accepts only the first message, so whole replays need a DEALER.
  Malformed requests (not exactly identity, delimiter, start) are logged and ignored,
  as in vLLM. The ROUTER's send high-water mark is ``2 * (buffer_steps + 1)``, vLLM's:
  ZMQ credits reads only every HWM/2 messages, so twice a full replay plus its marker
  always fits;
- ``data_parallel_rank`` fills the batch's field when the batch leaves it None, and
  offsets the endpoint: ``tcp://host:5557`` becomes ``tcp://host:5557+rank``,
  ``inproc://name`` becomes ``inproc://name_dp<rank>`` (see `offset_endpoint_port`);
- an endpoint containing ``*`` or ``::``, or an ``ipc://``/``inproc://`` one, is bound;
  any other is connected to (override with ``bind=``). The replay socket always binds.
  A bracketed IPv6 address (``tcp://[::1]:5557``) turns the socket's IPv6 option on.

Threading, where kvpool differs from vLLM on purpose: vLLM queues batches to a thread
that encodes and sends them. Here `publish` encodes and sends in the caller's thread,
because a PUB send never blocks (at the high-water mark ZMQ drops instead), so async
code can call it directly; the sequence number is then assigned synchronously and an
encoding error reaches the caller with nothing published. Only the replay ROUTER needs
a thread (a daemon polling every 100 ms), so it works the same under asyncio, uvloop
and trio. A lock makes `publish` safe from several threads and guards the replay buffer.

pyzmq is an optional dependency (``pip install 'kvpool[zmq]'``); it is imported when a
publisher is created, never when this module is.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import msgspec

from kvpool.errors import InvalidArgumentError
from kvpool.events.codec import EVENT_FORMATS, EventFormat, encode_batch
from kvpool.events.types import KVEventBatch

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay (its payload frame is empty)."""

DEFAULT_ENDPOINT = "tcp://*:5557"
_POLL_MS = 100
_MAX_PORT = 65535


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Return ``endpoint`` for ``data_parallel_rank``, exactly as vLLM derives it.

    Rank 0 and None are unchanged; ``inproc://x`` gets the suffix ``_dp<rank>``; a tcp
    endpoint's port grows by the rank (a wildcard ``*`` or ``0`` port, kvpool's
    addition, stays as it is). Raises `InvalidArgumentError` for any other endpoint
    with a rank above 0 (vLLM raises ``ValueError`` there too), and for a tcp port that
    ends up above 65535 (ZMQ would silently bind that port modulo 65536).
    """
    if not endpoint:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}" if data_parallel_rank else endpoint
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep or port in ("*", "0"):
            return endpoint
        try:
            number = int(port) + data_parallel_rank
        except ValueError:
            if data_parallel_rank == 0:
                return endpoint  # ZMQ itself judges what it cannot offset
            raise InvalidArgumentError(f"invalid tcp port in endpoint {endpoint!r}") from None
        if number > _MAX_PORT:
            raise InvalidArgumentError(
                f"tcp port {number} (endpoint {endpoint!r} + rank {data_parallel_rank}) "
                f"is above {_MAX_PORT}"
            )
        return f"{base}:{number}" if data_parallel_rank else endpoint
    if data_parallel_rank == 0:
        return endpoint
    raise InvalidArgumentError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")


def llmd_topic(host: str, port: int, model: str) -> str:
    """llm-d's per-pod topic, ``kv@<host>:<port>@<model>``: its KV-cache indexer
    subscribes with the prefix ``kv@`` and reads the pod and model from the topic, so a
    fleet of publishers can share one subscriber. ``host:port`` names the serving
    endpoint (the HTTP address the router sends requests to), not the ZMQ socket."""
    return f"kv@{host}:{port}@{model}"


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _is_ipv6(endpoint: str) -> bool:
    """A tcp endpoint on a bracketed IPv6 address (``tcp://[::1]:5557``): ZMQ sockets
    refuse those unless their IPv6 option is on (vLLM turns it on the same way)."""
    return endpoint.startswith("tcp://[")


def _check_count(name: str, value: int, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


class ZmqEventPublisher:
    """Publishes event batches like vLLM's ``ZmqEventPublisher`` (see the module doc).

    Use as a context manager (sync or async) or call `close`. Implements `EventSink`.
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        *,
        bind: bool | None = None,
        linger_ms: int = 1_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        event_format: EventFormat = "map",
    ) -> None:
        """Create the sockets (bound or connected) and, with a replay endpoint, its thread.

        ``buffer_steps`` batches are kept for replay; ``hwm`` is the PUB high-water mark;
        ``bind`` forces binding (True) or connecting (False) instead of vLLM's rule;
        ``linger_ms`` is how long unsent frames survive `close`; ``context`` defaults to
        pyzmq's shared ``zmq.Context.instance()``; ``event_format`` is vLLM 0.33.0's
        ``"map"`` or the legacy ``"array"`` (`kvpool.events.codec`). Raises ``ImportError``
        without pyzmq, `InvalidArgumentError` for a bad argument, and ``zmq.ZMQError`` if
        an endpoint cannot be bound or connected (nothing is left open then).
        """
        try:
            import zmq
        except ImportError as exc:
            raise ImportError(
                "ZmqEventPublisher needs pyzmq; install it with: pip install 'kvpool[zmq]'"
            ) from exc
        _check_count("data_parallel_rank", data_parallel_rank, 0)
        _check_count("buffer_steps", buffer_steps, 1)
        _check_count("hwm", hwm, 0)
        _check_count("linger_ms", linger_ms, 0)
        if event_format not in EVENT_FORMATS:
            raise InvalidArgumentError(
                f"event_format must be one of {EVENT_FORMATS}, got {event_format!r}"
            )
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str, got {topic!r}")
        if not isinstance(endpoint, str) or not endpoint:
            raise InvalidArgumentError(f"endpoint must be a non-empty str, got {endpoint!r}")
        if replay_endpoint is not None and (
            not isinstance(replay_endpoint, str) or not replay_endpoint
        ):
            raise InvalidArgumentError(
                f"replay_endpoint must be None or a non-empty str, got {replay_endpoint!r}"
            )
        pub_endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        replay_at = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert pub_endpoint is not None  # only None maps to None

        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._format: EventFormat = event_format
        self._linger_ms = linger_ms
        self._lock = threading.Lock()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        ctx = context if context is not None else zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.linger = linger_ms
            self._pub.ipv6 = _is_ipv6(pub_endpoint)
            binds = _binds(pub_endpoint) if bind is None else bind
            if binds:
                self._pub.bind(pub_endpoint)
                self._endpoint = self._pub.get_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(pub_endpoint)
                self._endpoint = pub_endpoint
            self._replay_endpoint: str | None = None
            if replay_at is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.ipv6 = _is_ipv6(replay_at)
                # vLLM's: ZMQ credits reads every HWM/2 messages, so a sender may see
                # HWM/2 stale ones; twice a whole replay plus its marker always fits
                # (a smaller mark would let ROUTER silently drop a replay's tail)
                self._replay.sndhwm = 2 * (buffer_steps + 1)
                self._replay.bind(replay_at)
                self._replay_endpoint = self._replay.get_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replays, name="kvpool-zmq-replay", daemon=True
            )
            self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB endpoint: the resolved address when bound (wildcard port filled in)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay ROUTER endpoint, or None without replay."""
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        """The topic frame of every published message (and of every replayed batch)."""
        return self._topic.decode()

    @property
    def data_parallel_rank(self) -> int:
        """The rank written into batches that carry none."""
        return self._rank

    @property
    def next_sequence(self) -> int:
        """The sequence number the next published batch will get (batches sent so far)."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closed

    def publish(self, batch: KVEventBatch) -> None:
        """Send ``batch`` as the next sequence number and keep it for replay.

        Never blocks (a subscriber past the high-water mark loses frames, as with any
        PUB socket; replay recovers them). Raises ``anyio.ClosedResourceError`` after
        `close`; the encoder's ``TypeError`` or ``OverflowError`` for a value msgpack
        cannot hold (an int beyond 64 bits); ``zmq.ZMQError`` if the send fails. On any
        error nothing is sent and the sequence number is not consumed.
        """
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._rank)
        payload = encode_batch(batch, self._format)
        with self._lock:
            if self._closed:
                raise anyio.ClosedResourceError
            seq = self._next_seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._next_seq = seq + 1

    def _serve_replays(self) -> None:
        replay = self._replay
        assert replay is not None
        while not self._stop.is_set():
            try:
                if replay.poll(_POLL_MS):
                    self._serve_one_replay(replay)
            except Exception:  # keep serving: one bad request must not end replays
                if self._stop.is_set():
                    return
                logger.exception("kvpool ZMQ replay: error serving a request")

    def _serve_one_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kvpool ZMQ replay: ignoring malformed request %r", frames)
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        with self._lock:
            batches = [item for item in self._buffer if item[0] >= start]
        for seq, payload in batches:
            replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Stop replays, close the sockets; unsent frames linger ``linger_ms``. Idempotent.

        Blocks until the replay thread ends (at most one poll interval, 100 ms, plus a
        replay being sent); from async code prefer `aclose`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._pub.close(linger=self._linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    async def aclose(self) -> None:
        """`close` in a worker thread, so the event loop keeps running meanwhile.

        If cancelled, the close still completes in its thread.
        """
        await anyio.to_thread.run_sync(self.close, abandon_on_cancel=False)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ZmqEventPublisher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<ZmqEventPublisher {state} endpoint={self._endpoint!r} "
            f"replay={self._replay_endpoint!r} next_sequence={self._next_seq}>"
        )


__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "ZmqEventPublisher",
    "llmd_topic",
    "offset_endpoint_port",
]
