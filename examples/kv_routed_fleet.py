"""A fleet of `kvpool serve` workers behind a KV-aware router whose index is NVIDIA
Dynamo's own (``python -m dynamo.indexer``, from ``pip install ai-dynamo-runtime``).

It starts the workers and the indexer on loopback, registers each worker's KV event and
replay sockets with the indexer, then routes multi-turn chats: each request goes to the
worker the indexer says holds the longest prefix of its prompt, and where none holds any,
to the one whose /metrics show the least prefill work (``vllm:prompt_tokens_total``). It
prints where each turn went and how much of its prompt that worker's cache served, then
stops the fleet (each worker must exit 0: no block leaked).

With ``--router package.module:factory`` the router is instead a `kvpool.routing` router,
the very object ``kvpool simulate --dispatch package.module:factory`` runs offline: it gets
each worker's KV events from its ZMQ stream (`LiveRouting`) and each worker's load from its
/metrics, and is asked ``choose`` with the request as a workload `RequestSpec` (whose token
ids are what is sent); no Dynamo indexer is started. ``examples/prefix_router.py`` is one.

Run:  python examples/kv_routed_fleet.py [--workers 3] [--chats 6] [--turns 3]
      PYTHONPATH=examples python examples/kv_routed_fleet.py --router prefix_router:make
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpool.events import BlockStored, decode_batch
from kvpool.routing import DispatchPolicy, RouterSettings, WorkerLoad, make_router, prompt_hashes
from kvpool.workloads import RequestSpec, Segment

MODEL = "kvpool-mock"
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 2048
SYSTEM_PROMPTS = 3
WAIT_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Worker:
    """One `kvpool serve` process: its HTTP URL and its KV event sockets."""

    instance: int
    process: subprocess.Popen[str]
    url: str
    pub_port: int
    replay_port: int

    def prefilled(self) -> float:
        """``vllm:prompt_tokens_total`` from the worker's /metrics."""
        text = httpx.get(f"{self.url}/metrics").text
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:prompt_tokens":  # the parser drops the _total suffix
                return sum(sample.value for sample in family.samples)
        raise SystemExit(f"worker {self.instance} reports no vllm:prompt_tokens_total")

    def load(self, index: int) -> WorkerLoad:
        """The worker's load as a `kvpool.routing` router reads it, from its /metrics."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            values[family.name] = sum(sample.value for sample in family.samples)
        return WorkerLoad(
            index=index,
            num_running=int(values.get("vllm:num_requests_running", 0)),
            num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
            active_blocks=round(values.get("vllm:kv_cache_usage_perc", 0.0) * NUM_GPU_BLOCKS),
            capacity=NUM_GPU_BLOCKS,
        )


@contextmanager
def worker(instance: int) -> Iterator[Worker]:
    """Start a worker; on exit stop it with SIGTERM and require exit status 0."""
    pub, replay = free_port(), free_port()
    command = [
        sys.executable, "-m", "kvpool", "serve", "--host", "127.0.0.1", "--port", "0",
        "--log-level", "warning", "--speedup-ratio", "0", "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--zmq-kv-event-port", str(pub),
        "--zmq-replay-port", str(replay), "--zmq-kv-event-host", "127.0.0.1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        url = ""
        for line in process.stderr:  # "kvpool serve: listening on http://HOST:PORT ..."
            if "listening on http://" in line:
                url = line.split("listening on ")[1].split()[0]
                break
        if not url:
            raise SystemExit(f"worker {instance} did not start")
        yield Worker(instance, process, url, pub, replay)
        process.send_signal(signal.SIGTERM)
        if process.wait(timeout=WAIT_S) != 0:
            raise SystemExit(f"worker {instance} exited {process.returncode}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextmanager
def indexer() -> Iterator[httpx.Client]:
    """Start Dynamo's standalone KV indexer; yield an HTTP client for its API."""
    port = free_port()
    command = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            def healthy() -> bool:
                if process.poll() is not None:
                    raise SystemExit("dynamo.indexer exited (is ai-dynamo-runtime installed?)")
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(healthy, "the indexer")
            yield client
    finally:
        process.kill()
        process.wait()


class Router:
    """Longest cached prefix by Dynamo's index; without one, the least prefill work."""

    def __init__(self, index: httpx.Client, workers: list[Worker]) -> None:
        self.index = index
        self.workers = {w.instance: w for w in workers}
        for w in workers:
            registration = {
                "instance_id": w.instance,
                "endpoint": f"tcp://127.0.0.1:{w.pub_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{w.replay_port}",
                "model_name": MODEL,
                "block_size": BLOCK_SIZE,
            }
            index.post("/register", json=registration).raise_for_status()
        wait_for(lambda: self._active() == set(self.workers), "every listener to connect")

    def _active(self) -> set[int]:
        listed = self.index.get("/workers", params={"model_name": MODEL}).json()
        return {w["instance_id"] for w in listed if w["status"] == "active"}

    def held(self, tokens: list[int]) -> dict[int, int]:
        """Tokens of ``tokens``' prefix each worker holds, by the indexer."""
        query = {"token_ids": tokens, "model_name": MODEL}
        scores = self.index.post("/query", json=query).json()["scores"]
        return {int(w): max(ranks.values(), default=0) for w, ranks in scores.items()}

    def route(self, tokens: list[int]) -> Worker:
        held = self.held(tokens)
        best = max(held.values(), default=0)
        if best:
            return self.workers[min(w for w, n in held.items() if n == best)]
        return min(self.workers.values(), key=lambda w: (w.prefilled(), w.instance))

    def complete(self, tokens: list[int]) -> tuple[Worker, int]:
        """Route and run one completion; return its worker and its cached prompt tokens."""
        chosen = self.route(tokens)
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 20}
        response = httpx.post(f"{chosen.url}/v1/completions", json=body, timeout=WAIT_S)
        response.raise_for_status()
        cached = int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # the indexer learns of the blocks from the worker's events: wait until it has
        full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
        wait_for(lambda: self.held(tokens).get(chosen.instance, 0) >= full, "the events")
        return chosen, cached


class LiveRouting:
    """A `kvpool.routing` router in front of the live workers: the same calls
    ``kvpool simulate`` makes, with events from the workers' ZMQ streams."""

    def __init__(self, policy: DispatchPolicy, workers: list[Worker]) -> None:
        import zmq

        self.policy = policy
        self.workers = workers
        self.context = zmq.Context()
        self.sockets = []
        for w in workers:
            sub = self.context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{w.pub_port}")
            self.sockets.append(sub)
        time.sleep(0.5)  # let each subscription reach its publisher before any event
        self.start = time.monotonic()
        self.stored: list[set[int]] = [set() for _ in workers]

    def pump(self) -> None:
        """Hand the router every event batch received so far."""
        import zmq

        now = time.monotonic() - self.start
        for index, sub in enumerate(self.sockets):
            while sub.poll(0):
                _, _, payload = sub.recv_multipart(zmq.NOBLOCK)
                events = decode_batch(payload).events
                for event in events:
                    if isinstance(event, BlockStored):
                        self.stored[index].update(event.block_hashes)
                self.policy.observe(index, events, now)

    def complete(self, spec: RequestSpec) -> tuple[Worker, int]:
        """Route and run one completion; return its worker and its cached prompt tokens."""
        self.pump()
        loads = [w.load(i) for i, w in enumerate(self.workers)]
        index = self.policy.choose(spec, loads, time.monotonic() - self.start)
        chosen = self.workers[index]
        body = {"model": MODEL, "prompt": spec.prompt_token_ids(), "max_tokens": 20}
        response = httpx.post(f"{chosen.url}/v1/completions", json=body, timeout=WAIT_S)
        response.raise_for_status()
        self.policy.finished(index, spec.request_id, time.monotonic() - self.start)
        cached = int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        # as the indexer mode does: wait until the worker's events for the prompt arrived
        last = prompt_hashes(spec, BLOCK_SIZE)[-1:]

        def arrived() -> bool:
            self.pump()
            return set(last) <= self.stored[index]

        wait_for(arrived, "the events")
        return chosen, cached

    def close(self) -> None:
        for sub in self.sockets:
            sub.close(linger=0)
        self.context.term()


def chat_segments(chat: int, system: int, turns: int) -> list[tuple[Segment, ...]]:
    """Each turn's prompt as workload segments: token ``j`` of a segment is its seed + j."""
    history = [Segment(1_000_000 * (system + 1), 400)]
    prompts = []
    for turn in range(turns):
        history.append(Segment(10_000 * (chat + 1) + 100 * turn, 50))
        prompts.append(tuple(history))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--router", metavar="MODULE:FACTORY", help="a kvpool.routing router")
    args = parser.parse_args()
    with ExitStack() as stack:
        workers = [stack.enter_context(worker(n + 1)) for n in range(args.workers)]
        live: LiveRouting | None = None
        router: Router | None = None
        if args.router:
            settings = RouterSettings(num_workers=args.workers, block_size=BLOCK_SIZE)
            live = LiveRouting(make_router(args.router, settings), workers)
            stack.callback(live.close)
        else:
            router = Router(stack.enter_context(indexer()), workers)
        for chat in range(args.chats):
            system = chat % SYSTEM_PROMPTS  # 400 tokens shared by every chat that uses it
            for turn, prompt in enumerate(chat_segments(chat, system, args.turns)):
                spec = RequestSpec(f"chat{chat}-turn{turn}", 0.0, prompt, Segment(0, 20))
                if live is not None:
                    chosen, cached = live.complete(spec)
                else:
                    assert router is not None
                    chosen, cached = router.complete(spec.prompt_token_ids())
                print(
                    f"chat {chat} (system prompt {system}) turn {turn}: worker "
                    f"{chosen.instance}, {cached} of {spec.input_length} prompt tokens cached"
                )
    print(f"fleet stopped: {args.workers} workers exited 0")


if __name__ == "__main__":
    main()
