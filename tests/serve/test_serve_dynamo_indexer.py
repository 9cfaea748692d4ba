"""Two ``kvpool serve`` workers behind NVIDIA Dynamo's own KV indexer (``python -m
dynamo.indexer``, from the ``ai-dynamo-runtime`` wheel), all real processes on loopback.

The indexer is the KV-aware half of Dynamo's router: it subscribes to each worker's PUB
socket, decodes vLLM's events with Dynamo's Rust decoder, re-hashes their token ids, and
answers ``/query`` with the tokens each worker holds of a prompt. What it reports must
follow what each worker's cache did: blocks stored, blocks evicted, and, for a listener
that joins late, the history it asks back from the worker's replay socket; with
``--data-parallel-size``, each rank's own cache on its own sockets (port + rank).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serve_processes import Served, free_port

# the test extra installs it where its wheels exist (Linux); nowhere else to get it
pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime ships Linux wheels only")

MODEL = "kvpool-mock"
BLOCK_SIZE = 16
GUARD_S = 20.0


class Indexer:
    """A ``python -m dynamo.indexer`` child process and its HTTP API."""

    def __init__(self) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5)
        try:
            wait_for(self._healthy, "the indexer to answer /health")
        except BaseException:
            self.close()
            raise

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"dynamo.indexer exited: {self.output()}")
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def register(self, instance: int, pub_port: int, replay_port: int, dp_rank: int = 0) -> None:
        response = self.http.post(
            "/register",
            json={
                "instance_id": instance,
                "endpoint": f"tcp://127.0.0.1:{pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
                "dp_rank": dp_rank,
            },
        )
        assert response.is_success, response.text  # 201 Created

    def active(self) -> set[int]:
        workers = self.http.get("/workers", params={"model_name": MODEL}).json()
        return {w["instance_id"] for w in workers if w["status"] == "active"}

    def held_by_rank(self, tokens: list[int]) -> dict[tuple[int, int], int]:
        """Tokens of ``tokens``' prefix each (worker, dp rank) holds (0s left out)."""
        response = self.http.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        assert response.status_code == 200, response.text
        scores: dict[str, dict[str, int]] = response.json()["scores"]
        return {
            (int(instance), int(rank)): matched
            for instance, ranks in scores.items()
            for rank, matched in ranks.items()
            if matched
        }

    def held(self, tokens: list[int]) -> dict[int, int]:
        """Tokens of ``tokens``' prefix each worker holds, by the indexer (0s left out)."""
        held: dict[int, int] = {}
        for (instance, _), matched in self.held_by_rank(tokens).items():
            held[instance] = max(held.get(instance, 0), matched)
        return held

    def output(self) -> str:
        """What the indexer logged so far."""
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self.log.close()


def wait_for(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until true; fail after `GUARD_S` (events cross processes)."""
    deadline = time.monotonic() + GUARD_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def indexers() -> Iterator[Callable[[], Indexer]]:
    """Start indexers on demand; all are stopped at the end."""
    started: list[Indexer] = []

    def start() -> Indexer:
        started.append(Indexer())
        return started[-1]

    yield start
    for indexer in started:
        indexer.close()


@pytest.fixture
def workers() -> Iterator[list[tuple[Served, int, int]]]:
    """Two workers, each (server, PUB port, replay port); 64 blocks of 16 tokens each."""
    started: list[tuple[Served, int, int]] = []
    try:
        for _ in range(2):
            pub, replay = free_port(), free_port()
            server = Served(
                "--port", "0", "--log-level", "warning", "--speedup-ratio", "0",
                "--num-gpu-blocks", "64", "--block-size", str(BLOCK_SIZE),
                "--zmq-kv-event-port", str(pub), "--zmq-replay-port", str(replay),
                "--zmq-kv-event-host", "127.0.0.1",
            )  # fmt: skip
            started.append((server, pub, replay))
        yield started
    finally:
        for server, _, _ in started:
            server.kill()


def prompt(first: int) -> list[int]:
    """100 token ids: six full blocks of 16 (what a cache can name) and a partial tail."""
    return list(range(first, first + 100))


def complete(server: Served, tokens: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 4}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=GUARD_S)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.mark.slow
def test_dynamos_indexer_follows_each_workers_cache_and_replays_what_it_missed(
    indexers: Callable[[], Indexer], workers: list[tuple[Served, int, int]]
) -> None:
    (one, pub_one, replay_one), (two, pub_two, replay_two) = workers
    indexer = indexers()
    indexer.register(1, pub_one, replay_one)
    indexer.register(2, pub_two, replay_two)
    wait_for(lambda: indexer.active() == {1, 2}, "both listeners to connect")

    # stored: each worker holds the six full blocks of the prompt it served, and only it
    a, b = prompt(1000), prompt(5000)
    complete(one, a)
    complete(two, b)
    wait_for(lambda: indexer.held(a) == {1: 96}, "worker 1's blocks of prompt A")
    wait_for(lambda: indexer.held(b) == {2: 96}, "worker 2's blocks of prompt B")
    # the same prompt again reuses worker 1's cache: the usage says so, the index agrees
    assert complete(one, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 96

    # evicted: 20 more prompts cache 120 blocks in worker 1's 64; A's are the oldest
    fillers = [prompt(20_000 + 1000 * n) for n in range(20)]
    for filler in fillers:
        complete(one, filler)
    wait_for(lambda: indexer.held(fillers[-1]) == {1: 96}, "the last filler's blocks")
    assert indexer.held(a) == {}
    assert indexer.held(b) == {2: 96}  # worker 2's cache is its own
    assert complete(one, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # replayed: an indexer that joins now finds its first live batch past sequence 0 and
    # asks worker 1's replay socket for everything before it (vLLM 0.33.0's framing)
    late = indexers()
    late.register(1, pub_one, replay_one)
    wait_for(lambda: late.active() == {1}, "the late listener to connect")
    c = prompt(90_000)
    complete(one, c)
    wait_for(lambda: late.held(c) == {1: 96}, "the late indexer's live batch")
    for tokens in [a, c, *fillers]:
        assert late.held(tokens) == indexer.held(tokens), tokens
    assert late.held(fillers[-1]) == {1: 96}  # stored before it joined
    assert "Replay complete" in late.output()

    for server, _, _ in workers:
        status, log = server.stop()
        assert status == 0, log


def free_port_pair() -> int:
    """A port P with P + 1 free too: a rank-1 socket binds at the base port plus one."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.mark.slow
def test_each_data_parallel_rank_publishes_its_own_cache_at_port_plus_rank(
    indexers: Callable[[], Indexer],
) -> None:
    pub, replay = free_port_pair(), free_port_pair()
    # real time and 50 ms steps: two requests sent together overlap, so least-loaded
    # dispatch sends them to different ranks
    server = Served(
        "--port", "0", "--log-level", "warning", "--data-parallel-size", "2",
        "--step-overhead-ms", "50",
        "--block-size", str(BLOCK_SIZE), "--zmq-kv-event-port", str(pub),
        "--zmq-replay-port", str(replay), "--zmq-kv-event-host", "127.0.0.1",
    )  # fmt: skip
    try:
        indexer = indexers()
        for rank in (0, 1):
            indexer.register(1, pub + rank, replay + rank, dp_rank=rank)
        wait_for(lambda: indexer.active() == {1}, "both ranks' listeners to connect")
        a, b = prompt(1000), prompt(5000)
        with ThreadPoolExecutor(2) as pool:
            usages = list(pool.map(lambda tokens: complete(server, tokens)["usage"], [a, b]))
        assert [u["prompt_tokens"] for u in usages] == [100, 100]
        wait_for(lambda: len(indexer.held_by_rank(a)) == len(indexer.held_by_rank(b)) == 1,
                 "both prompts' blocks")  # fmt: skip
        [(worker_a, rank_a)] = indexer.held_by_rank(a)
        [(worker_b, rank_b)] = indexer.held_by_rank(b)
        assert (worker_a, worker_b) == (1, 1)
        assert {rank_a, rank_b} == {0, 1}  # dispatched to one rank each, held there only
        assert indexer.held_by_rank(a)[1, rank_a] == indexer.held_by_rank(b)[1, rank_b] == 96
        status, log = server.stop()
        assert status == 0, log
    finally:
        server.kill()
