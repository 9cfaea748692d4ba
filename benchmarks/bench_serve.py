"""kvpool serve under load: N concurrent streaming requests over real HTTP (loopback).

At speedup 1 it prints the worst lag of the simulated clock behind the wall clock (how
late, in wall time, a step's tokens left the engine task after the instant the step
ends; the issue's target is 10 ms), how many steps were more than 10 ms late, and the
median and 90th percentile. At speedup 0 (as fast as possible) it prints
requests and generated tokens per second. The server runs in this process on uvloop
(in-process so the engine driver's lag is readable); the clients run in a
child process (a minimal asyncio HTTP client), so the figures are the server's, not
the client's (on a machine with fewer than two free cores the two still compete for
CPU). Usage:

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
    args = parser.parse_args()
    for speedup in (1.0, 0.0):
        anyio.run(
            load,
            speedup,
            args.requests,
            args.max_tokens,
            args.prompt_words,
            backend="asyncio",
            backend_options={"use_uvloop": True},
        )


if __name__ == "__main__":
    main()
