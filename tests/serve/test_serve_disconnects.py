"""A client that leaves has its requests aborted, whatever kind they are: streaming or
not, queued or running, a closed or half-closed socket; one that leaves mid-upload is
no error (no traceback in the log). Raw sockets on loopback, as clients really leave."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
from raw_http import connect, drop, read_head, request_bytes
from uvicorn_backends import uvicorn_backend_fixture

from kvpool.engine import EngineConfig, TimingModel
from kvpool.serve import ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 30
MODEL = "kvpool-mock"


anyio_backend = uvicorn_backend_fixture()


class ServerErrors(logging.Handler):
    """What uvicorn logs at WARNING and above, from `watch` on (attach it once the server
    runs: uvicorn's logging setup replaces its loggers' handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextmanager
    def watch(self) -> Iterator[ServerErrors]:
        logger = logging.getLogger("uvicorn.error")
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)


def paced_state(max_num_seqs: int = 256) -> ServeState:
    # 10 ms steps at real time: a 3000-token request would run for 30 s
    timing = TimingModel(step_overhead_s=0.01)
    config = EngineConfig(
        num_gpu_blocks=1024, block_size=16, max_num_seqs=max_num_seqs, timing=timing
    )
    return ServeState(config, speedup_ratio=1.0)


async def wait_for(condition: Any) -> None:
    while not condition():
        await anyio.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("half_close", [False, True], ids=["closed", "half-closed"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_running_request_whose_client_leaves_is_aborted(
    stream: bool, half_close: bool
) -> None:
    state = paced_state()
    body = {"model": MODEL, "prompt": "write at length", "max_tokens": 3000, "stream": stream}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            _, writer = await connect(url)
            writer.write(request_bytes("/v1/completions", body))
            engine = state.drivers[0].engine
            assert engine is not None
            await wait_for(lambda: engine.running and engine.running[0].num_output > 2)
            if half_close:
                writer.write_eof()  # the request is sent; the client reads no more
            else:
                await drop(writer)
            await wait_for(lambda: engine.stats.aborted == 1)
            assert not engine.has_work
            assert (await engine.final_usage()).num_active == 0
            writer.close()
    assert engine.stats.completed == 0
    assert state.drivers[0].outstanding == 0
    assert state.leaked_blocks == 0


@pytest.mark.slow
async def test_a_queued_non_streaming_request_whose_client_leaves_never_runs() -> None:
    state = paced_state(max_num_seqs=1)
    first = {"model": MODEL, "prompt": "first in line", "max_tokens": 40}
    queued = {"model": MODEL, "prompt": "second in line", "max_tokens": 3000}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            engine = state.drivers[0].engine
            assert engine is not None
            async with anyio.create_task_group() as tasks:
                answers: list[httpx.Response] = []

                async def run_first() -> None:
                    answers.append(await client.post("/v1/completions", json=first))

                tasks.start_soon(run_first)
                await wait_for(lambda: engine.running)
                _, writer = await connect(url)
                writer.write(request_bytes("/v1/completions", queued))
                await wait_for(lambda: engine.waiting)
                await drop(writer)
                await wait_for(lambda: engine.stats.aborted == 1)
                assert engine.running  # the first one is still decoding
    [answer] = answers
    assert answer.status_code == 200
    assert engine.stats.completed == 1  # the queued one never ran
    assert state.leaked_blocks == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_client_leaving_mid_upload_is_no_error(path: str) -> None:
    state = paced_state()
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            with ServerErrors().watch() as errors:
                _, writer = await connect(url)
                writer.write(
                    b"POST %s HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 100000\r\n\r\n{"model": "kvpool-mock", "prompt": "'
                    % path.encode()
                )
                await writer.drain()
                await anyio.sleep(0.1)  # the handler is reading the body
                await drop(writer)
                await anyio.sleep(0.1)
                ok = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": "still here", "max_tokens": 1},
                )
    assert ok.status_code == 200
    assert [r.getMessage() for r in errors.records] == []
    assert state.leaked_blocks == 0


async def test_a_finished_non_streaming_answer_still_arrives_whole() -> None:
    # the disconnect listener must not mistake the end of the body for a departure
    state = paced_state()
    body = {"model": MODEL, "prompt": "short", "max_tokens": 5}
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            reader, writer = await connect(url)
            writer.write(request_bytes("/v1/completions", body))
            status, _ = await read_head(reader)
            rest = await reader.read()
            writer.close()
    assert status == 200
    assert b'"completion_tokens":5' in rest
