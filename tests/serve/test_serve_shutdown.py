"""Bounded shutdown: SIGTERM/SIGINT stop accepting, the requests in flight get at most
``--shutdown-timeout`` seconds, then everything still running is aborted (a client
that stopped reading included), the leak check runs and the exit status is 0; a second
signal does the same at once. Real processes and sockets on loopback."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator

import anyio
import pytest
from raw_http import connect, read_head, request_bytes
from serve_processes import Served
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig
from kvpool.serve import ServeState, running_server

MODEL = "kvpool-mock"
GUARD_S = 30
# 256 prompts streamed at full speed: tens of MB of events, far more than the socket
# buffers between the server and a client that never reads
FLOOD = {"model": MODEL, "prompt": ["flood the socket"] * 256, "max_tokens": 4000, "stream": True}


@pytest.fixture
def served() -> Iterator[type[Served]]:
    started: list[Served] = []

    class Tracked(Served):
        def __init__(self, *flags: str) -> None:
            super().__init__(*flags)
            started.append(self)

    yield Tracked
    for server in started:
        server.kill()


def stalled_reader(url: str) -> socket.socket:
    """A client that sends a flooding stream request and never reads the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(request_bytes("/v1/completions", FLOOD))
    return sock


def finish(server: Served) -> tuple[int, str, float]:
    """Wait for the process to exit: its status, its log and how long it took."""
    start = time.monotonic()
    _, rest = server.process.communicate(timeout=60)
    return server.process.returncode, "".join(server.log) + rest, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("timeout", [None, "1"], ids=["default-timeout", "one-second"])
def test_a_stalled_reader_at_sigterm_is_aborted_at_the_timeout(
    served: type[Served], timeout: str | None
) -> None:
    flags = () if timeout is None else ("--shutdown-timeout", timeout)  # default: 0
    server = served("--port", "0", "--log-level", "warning", "--speedup-ratio", "0",
                    "--num-gpu-blocks", "65536", *flags)  # fmt: skip
    sock = stalled_reader(server.url)
    try:
        time.sleep(0.3)  # streaming: 130 MB that the client will never read
        server.process.send_signal(signal.SIGTERM)
        status, log, _ = finish(server)
    finally:
        sock.close()
    assert status == 0, log
    assert "Traceback" not in log
    assert "256 request(s) aborted at the shutdown timeout" in log
    assert "no KV block left active" in log


@pytest.mark.slow
@pytest.mark.parametrize(
    "signals",
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM)],
    ids=["double-SIGINT", "double-SIGTERM"],
)
def test_a_second_signal_aborts_at_once_and_still_checks_for_leaks(
    served: type[Served], signals: tuple[int, int]
) -> None:
    # an hour's timeout: only the second signal can end this in time
    server = served("--port", "0", "--log-level", "warning", "--speedup-ratio", "0",
                    "--num-gpu-blocks", "65536", "--shutdown-timeout", "3600")  # fmt: skip
    sock = stalled_reader(server.url)
    try:
        time.sleep(0.3)
        server.process.send_signal(signals[0])
        time.sleep(0.3)
        assert server.process.poll() is None  # the first one waits for the stream
        server.process.send_signal(signals[1])
        status, log, _ = finish(server)
    finally:
        sock.close()
    assert status == 0, log
    assert "Traceback" not in log
    assert "CancelledError" not in log
    assert "256 request(s) aborted" in log
    assert "no KV block left active" in log


anyio_backend = uvicorn_backend_fixture()


@pytest.mark.anyio
async def test_an_embedded_server_stops_in_time_with_a_stalled_reader() -> None:
    state = ServeState(EngineConfig(num_gpu_blocks=65536), speedup_ratio=0.0)
    with anyio.fail_after(GUARD_S):
        async with running_server(state, shutdown_timeout=0) as url:
            reader, writer = await connect(url)
            writer.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVBUF, 4096
            )
            writer.write(request_bytes("/v1/completions", FLOOD))
            status, _ = await read_head(reader)
            engine = state.drivers[0].engine
            assert engine is not None
            # streaming 130 MB that the client will never read: the handler is (or is
            # about to be) stuck writing, and the stream can never complete
            while engine.stats.generated_tokens < 10_000:
                await asyncio.sleep(0.01)
        writer.close()
    assert status == 200
    assert state.shutdown_aborted == 256
    assert state.leaked_blocks == 0
    aborted = state.metrics.registry.get_sample_value(
        "vllm:request_success_total",
        {"model_name": MODEL, "engine": "0", "finished_reason": "abort"},
    )
    assert aborted == 256
