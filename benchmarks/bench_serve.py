"""kvpool serve under load: N concurrent streaming requests over real HTTP (loopback).

At speedup 1 it prints the worst lag of the simulated clock behind the wall clock (how
late, in wall time, a step's tokens left the engine task after the instant the step
ends; the issue's target is 10 ms), how many steps were more than 10 ms late, and the
median and 90th percentile. At speedup 0 (as fast as possible) it prints
requests and generated tokens per second. The server runs in this process on uvloop
(in-process so the engine driver's lag is readable); the clients run in a
child process (a minimal asyncio HTTP client), so the figures are the server's, not
the client's (on a machine with fewer than two free cores the two still compete for
CPU).

A third phase measures that no request stalls the others: at speedup 1, while 64
streams keep the engine busy and a probe (its own process) sends small requests one
after another, a client sends a 50 MB body (declared length), a 50 MB chunked body (no
length: read up to the limit) and a 50,000-prompt batch, as naive clients do (the
whole body, whatever the server answers). It prints how each was refused and how fast,
and the small requests' worst latency and the engine clock's worst lag, calm (before
the offenders) and while they are refused. Usage:

    python benchmarks/bench_serve.py                # 500 requests, the issue's load
    python benchmarks/bench_serve.py --requests 50  # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections import Counter
from multiprocessing import Queue
from typing import Any

import anyio
import anyio.to_thread
import uvloop

from kvpool.engine import EngineConfig
from kvpool.serve import ServeState, running_server
from kvpool.serve.protocol import MAX_COMPLETION_PROMPTS

MODEL = "kvpool-mock"


def clients(url: str, requests: int, max_tokens: int, words: int, out: Queue[Any]) -> None:
    """The child process: every request at once, streamed; report (tokens, failures,
    wall-clock start and end of the load).

    A minimal HTTP/1.1 client on asyncio streams (one connection per request,
    ``Connection: close``): an SSE client in Python costs more CPU than the server per
    token, and this one costs little, so the figures stay the server's."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    shared = " ".join(["system", "prompt"] * (words // 4))

    async def one(n: int) -> tuple[int, bool]:
        prompt = f"{shared} user {n} " + " ".join(f"w{n}x{i}" for i in range(words // 2))
        body = json.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        ).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body)
        )
        received = bytearray()
        while chunk := await reader.read(65536):
            received += chunk
        writer.close()
        ok = received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in received
        return received.count(b"data: {"), ok

    async def run() -> tuple[int, int, float, float]:
        start = time.time()
        results = await asyncio.gather(*(one(n) for n in range(requests)))
        end = time.time()
        return sum(t for t, _ in results), sum(not ok for _, ok in results), start, end

    out.put(uvloop.run(run()))


async def load(speedup: float, requests: int, max_tokens: int, prompt_words: int) -> None:
    state = ServeState(EngineConfig(num_gpu_blocks=8192), speedup_ratio=speedup)
    context = multiprocessing.get_context("spawn")
    results: Queue[Any] = context.Queue()
    async with running_server(state, log_level="error", freeze_gc=True) as url:  # as serve
        child = context.Process(
            target=clients, args=(url, requests, max_tokens, prompt_words, results)
        )
        child.start()
        tokens, failures, start, end = await anyio.to_thread.run_sync(results.get)
        wall = end - start
        await anyio.to_thread.run_sync(child.join)
    driver = state.drivers[0]
    engine = driver.engine
    assert engine is not None
    label = "as fast as possible" if speedup == 0 else f"speedup {speedup:g}"
    print(f"{label}: {requests} concurrent streaming requests x {max_tokens} tokens")
    print(f"  wall time            {wall:8.3f} s   (first request sent to last token read)")
    print(f"  requests per second  {requests / wall:8.1f}")
    print(f"  tokens per second    {tokens / wall:8.1f}   ({tokens} streamed tokens)")
    if speedup > 0:
        print(f"  worst clock lag      {driver.worst_lag_s * 1e3:8.3f} ms (target: 10 ms)")
        counts = driver.lag_counts
        steps = sum(counts.values())
        late = sum(n for ms, n in counts.items() if ms > 10)
        print(
            f"  steps late > 10 ms   {late:8d}   of {steps} paced steps; median "
            f"<= {_percentile(counts, 0.5)} ms, p90 <= {_percentile(counts, 0.9)} ms"
        )
    print(f"  failed requests      {failures:8d}   leaked blocks {state.leaked_blocks}")


BIG_BODY = 50 * 2**20
BIG_BATCH = 50_000
CALM_S = 3.0  # before the offenders: the streams start, then the calm window
CALM_WINDOW_S = 2.0
TAIL_S = 0.5  # the probe after each offender


def _post(host: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
        b"\r\nConnection: close\r\n%s\r\n%s" % (host.encode(), extra, body)
    )


def probe(url: str, done: Any, out: Queue[Any]) -> None:
    """A child process: small non-streaming requests one after another until ``done``
    (a multiprocessing event) is set; reports (wall-clock start, latency) of each."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": "a small request", "max_tokens": 1}).encode()
    request = _post(host, body, b"Content-Length: %d\r\n" % len(body))

    async def run() -> list[tuple[float, float]]:
        samples = []
        while not done.is_set():
            start = time.perf_counter()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            received = await reader.read()
            writer.close()
            assert received.startswith(b"HTTP/1.1 200"), received[:200]
            samples.append((time.time(), time.perf_counter() - start))
            await asyncio.sleep(0.01)
        return samples

    out.put(uvloop.run(run()))


def offenders(url: str, streams: int, done: Any, out: Queue[Any]) -> None:
    """A child process: ``streams`` long streams read steadily; after `CALM_S`, the
    three oversized requests one after another. Reports each offender's (name, outcome,
    wall-clock start, seconds to its answer) and when the offenders ended, and sets
    ``done``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def status_of(reader: asyncio.StreamReader) -> str:
        try:
            line = await reader.readline()
        except ConnectionError:
            return "reset"
        return line.split(b" ", 2)[1].decode() if line else "closed"

    async def stream(n: int, stop: asyncio.Event) -> None:
        body = json.dumps(
            {"model": MODEL, "prompt": f"stream {n}", "max_tokens": 100_000, "stream": True}
        ).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_post(host, body, b"Content-Length: %d\r\n" % len(body)))
        while not stop.is_set() and await reader.read(65536):
            pass
        writer.transport.abort()

    async def send_big(chunked: bool) -> str:
        reader, writer = await asyncio.open_connection(host, int(port))
        if chunked:
            writer.write(_post(host, b"", b"Transfer-Encoding: chunked\r\n"))
        else:
            writer.write(_post(host, b"", b"Content-Length: %d\r\n" % BIG_BODY))
        piece = b'{"model": "kvpool-mock", "prompt": "' + b"x" * (2**20 - 36)
        try:  # a naive client: the whole body, whatever the server says
            for _ in range(BIG_BODY // len(piece)):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()
            writer.write(b"0\r\n\r\n" if chunked else b"")
            await writer.drain()
        except ConnectionError:
            pass
        outcome = await status_of(reader)
        writer.transport.abort()
        return outcome

    async def send_batch() -> str:
        body = json.dumps({"model": MODEL, "prompt": ["word"] * BIG_BATCH}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_post(host, body, b"Content-Length: %d\r\n" % len(body)))
        outcome = await status_of(reader)
        writer.close()
        return outcome

    async def run() -> tuple[list[tuple[str, str, float, float]], float]:
        stop = asyncio.Event()
        background = [asyncio.create_task(stream(n, stop)) for n in range(streams)]
        await asyncio.sleep(CALM_S)
        results = []
        for name, send in (
            ("50 MB body, Content-Length", lambda: send_big(chunked=False)),
            ("50 MB body, chunked", lambda: send_big(chunked=True)),
            (f"{BIG_BATCH:,}-prompt batch", send_batch),
        ):
            start = time.perf_counter()
            wall = time.time()
            outcome = await send()
            results.append((name, outcome, wall, time.perf_counter() - start))
            await asyncio.sleep(TAIL_S)
        ended = time.time()
        done.set()
        stop.set()
        await asyncio.gather(*background)
        return results, ended

    out.put(uvloop.run(run()))


async def refusals(streams: int) -> None:
    state = ServeState(EngineConfig(num_gpu_blocks=8192), speedup_ratio=1.0)
    context = multiprocessing.get_context("spawn")
    offended: Queue[Any] = context.Queue()
    probed: Queue[Any] = context.Queue()
    done = context.Event()
    lags: list[tuple[float, float]] = []  # (wall time, worst lag of the last 20 ms)
    async with running_server(state, log_level="error", freeze_gc=True) as url:
        driver = state.drivers[0]
        children = [
            context.Process(target=offenders, args=(url, streams, done, offended)),
            context.Process(target=probe, args=(url, done, probed)),
        ]
        for child in children:
            child.start()
        async with anyio.create_task_group() as tasks:

            async def sample_lag() -> None:
                while True:
                    await anyio.sleep(0.02)
                    lags.append((time.time(), driver.worst_lag_s))
                    driver.worst_lag_s = 0.0

            tasks.start_soon(sample_lag)
            outcomes, ended = await anyio.to_thread.run_sync(offended.get)
            samples = await anyio.to_thread.run_sync(probed.get)
            tasks.cancel_scope.cancel()
        for child in children:
            await anyio.to_thread.run_sync(child.join)
    began = outcomes[0][2]
    calm = [latency for start, latency in samples if began - CALM_WINDOW_S <= start < began]
    during = [latency for start, latency in samples if began <= start < ended]
    calm_lag = max((lag for t, lag in lags if began - CALM_WINDOW_S <= t < began), default=0)
    during_lag = max((lag for t, lag in lags if began <= t < ended), default=0)
    limits = state.limits
    print(
        f"refusals at speedup 1: {streams} streams decoding, a probe of small requests "
        f"(body limit {limits.body_bytes:,} bytes, batches of at most "
        f"{MAX_COMPLETION_PROMPTS})"
    )
    for name, outcome, _, seconds in outcomes:
        print(f"  {name:28} {outcome:>6} after {seconds * 1e3:8.1f} ms")
    for label, latencies, lag in (("calm", calm, calm_lag), ("refusing", during, during_lag)):
        ordered = sorted(latencies)
        print(
            f"  small requests, {label:9}  worst {ordered[-1] * 1e3:7.1f} ms, median "
            f"{ordered[len(ordered) // 2] * 1e3:6.1f} ms ({len(ordered)} requests); worst "
            f"engine clock lag {lag * 1e3:6.1f} ms"
        )
    print(f"  leaked blocks {state.leaked_blocks}")


def _percentile(counts: Counter[int], q: float) -> int:
    """The smallest whole-millisecond lateness that ``q`` of the steps stay within."""
    total = sum(counts.values())
    seen = 0
    for ms in sorted(counts):
        seen += counts[ms]
        if seen >= q * total:
            return ms
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument(
        "--refusal-streams", type=int, default=64, help="streams busy during the refusals"
    )
    parser.add_argument("--only-refusals", action="store_true", help="the third phase alone")
    args = parser.parse_args()
    options: dict[str, Any] = {"backend": "asyncio", "backend_options": {"use_uvloop": True}}
    if not args.only_refusals:
        for speedup in (1.0, 0.0):
            anyio.run(load, speedup, args.requests, args.max_tokens, args.prompt_words, **options)
    anyio.run(refusals, args.refusal_streams, **options)


if __name__ == "__main__":
    main()
