"""``kvpool serve`` as a process: SIGTERM/SIGINT while streaming, KV events with replay
and llm-d's topic, bad flags; and the ``--tokenizer`` loader with a real tokenizer.json."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from serve_processes import ROOT, Served, free_port

from kvpool.events import decode_batch
from kvpool.serve import HfTokenizer

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[type[Served]]:
    started: list[Served] = []

    class Tracked(Served):
        def __init__(self, *flags: str) -> None:
            super().__init__(*flags)
            started.append(self)

    yield Tracked
    for server in started:
        server.kill()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_stream_lets_the_request_finish_within_the_timeout(
    served: type[Served], sig: int
) -> None:
    # a step takes 1 s of simulated time at speedup 20 (50 ms of wall time): the stream
    # of 60 tokens is in flight for 3 s, long after the listening socket closed
    server = served("--port", "0", "--log-level", "warning", "--step-overhead-ms", "1000",
                    "--speedup-ratio", "20", "--shutdown-timeout", "30")  # fmt: skip
    body = {"model": "kvpool-mock", "prompt": "tell me more", "max_tokens": 60, "stream": True}
    chunks = 0
    with (
        httpx.Client(base_url=server.url, timeout=20) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks += 1
                break
        server.process.send_signal(sig)  # the stream is in flight: it must still finish
        refused = False
        for _ in range(200):  # stop accepting: new connections are refused (within 2 s)
            try:
                httpx.get(f"{server.url}/health", timeout=1)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                # refused, or reset unanswered: the kernel may complete a handshake into
                # the backlog just before uvicorn closes the listening socket
                refused = True
                break
            time.sleep(0.01)
        assert refused
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunks += 1
    assert done
    assert chunks == 60
    status, log = server.stop(sig)  # a second signal after the exit is harmless
    assert status == 0, log
    assert "still active" not in log


def test_events_replay_with_vllms_framing_and_llm_ds_topic(served: type[Served]) -> None:
    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    server = served(
        "--port", str(http_port), "--log-level", "warning", "--speedup-ratio", "0",
        "--zmq-kv-event-port", str(pub_port), "--zmq-replay-port", str(replay_port),
        "--zmq-kv-event-host", "127.0.0.1", "--zmq-kv-event-topic", "llm-d",
    )  # fmt: skip
    topic = f"kv@127.0.0.1:{http_port}@kvpool-mock".encode()
    with httpx.Client(base_url=server.url, timeout=20) as client:
        response = client.post(
            "/v1/completions",
            json={"model": "kvpool-mock", "prompt": "a b c d e f g h i j k l m n o p q r"},
        )
        assert response.status_code == 200
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = 10_000
    try:
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = dealer.recv_multipart()
            assert len(frames) == 4  # delimiter, topic, seq, payload: vLLM 0.33.0's
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            assert frames[:2] == [b"", topic]
            replayed.append((int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
    finally:
        dealer.close()
        ctx.term()
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert replayed[0][1].events[0].block_size == 16  # type: ignore[union-attr]
    status, log = server.stop()
    assert status == 0, log


def test_the_body_limit_flag_reaches_the_server(served: type[Served]) -> None:
    server = served("--port", "0", "--log-level", "warning", "--speedup-ratio", "0",
                    "--max-request-body-bytes", "200")  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=20) as client:
        big = client.post("/v1/completions", json={"model": "kvpool-mock", "prompt": "x" * 300})
        fine = client.post("/v1/completions", json={"model": "kvpool-mock", "prompt": "x" * 100})
    assert big.status_code == 413
    assert "--max-request-body-bytes" in big.json()["error"]["message"]
    assert fine.status_code == 200
    status, log = server.stop()
    assert status == 0, log


@pytest.mark.slow
def test_bad_serve_flags_fail_before_serving(tmp_path: Path) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvpool", "serve", "--host", "127.0.0.1", *flags],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )

    no_pub = run("--port", "0", "--zmq-replay-port", "6000")
    assert no_pub.returncode == 2
    assert "--zmq-replay-port needs --zmq-kv-event-port" in no_pub.stderr
    missing = run("--port", "0", "--tokenizer", str(tmp_path / "nope.json"))
    assert missing.returncode == 1
    assert "--tokenizer" in missing.stderr
    negative = run("--speedup-ratio", "-1")
    assert negative.returncode == 2


def test_a_local_tokenizer_json_encodes_and_decodes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    loaded = HfTokenizer(str(path))
    assert loaded.encode("hello world kv zzz") == [1, 2, 3, 0]
    assert loaded.decode_token(2) == "world"
    assert loaded.decode_token(4 + 3) == "kv"  # generated ids wrap around the vocabulary
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        HfTokenizer(str(tmp_path / "broken.json"))


def test_model_names_the_served_model_and_a_local_one_the_tokenizer(tmp_path: Path) -> None:
    """vLLM's rules: ``vllm serve MODEL`` (or ``--model``) serves the name MODEL unless
    ``--served-model-name`` says otherwise, and loads its tokenizer from MODEL unless
    ``--tokenizer`` does; a hub name cannot be loaded offline, so the built-in
    tokenizer stands in for it."""
    from kvpool.cli import build_parser
    from kvpool.serve.command import ServedModel, resolve_model

    parser = build_parser()

    def resolved(*argv: str) -> ServedModel:
        return resolve_model(parser.parse_args(["serve", *argv]), parser)

    local = str(tmp_path)
    assert resolved() == ServedModel("kvpool-mock", None, "")
    assert resolved("--model", "org/llm") == ServedModel("org/llm", None, "")
    assert resolved("org/llm", "--served-model-name", "x") == ServedModel("x", None, "")
    assert resolved(local) == ServedModel(local, local, "MODEL")
    assert resolved("--model", "m", "--tokenizer", local) == ServedModel("m", local, "--tokenizer")
    missing = str(tmp_path / "nowhere")
    assert resolved(missing) == ServedModel(missing, missing, "MODEL")  # fails to load
    with pytest.raises(SystemExit):
        resolved("a", "--model", "b")
