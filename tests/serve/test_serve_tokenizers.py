"""``--tokenizer`` as vLLM users pass it, and streamed text decoded incrementally.

The tokenizers are built here with the ``tokenizers`` library (nothing is downloaded):
a byte-level BPE (GPT-2 style: spaces and multi-byte characters live inside tokens) and
a SentencePiece-style Metaspace BPE with byte fallback (Llama style: a word's leading
space is the ``▁`` of its first piece, dropped at the start of a decode). Token by token
decoding loses the Metaspace spaces and splits the byte-level characters; the contract
is that the deltas join to the decode of the whole sequence.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from openai import AsyncOpenAI
from serve_processes import Served
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvpool.engine import EngineConfig
from kvpool.serve import HfTokenizer, ServeState, running_server

pytestmark = pytest.mark.anyio
GUARD_S = 20
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu, 日本語のテキスト and emoji 🚀 too",
    "routers score workers by their kv cache usage and queue length",
] * 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the server is uvicorn's: asyncio-bound


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def metaspace() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>", "<s>", *bytes_])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def model_directory(tmp_path: Path, tokenizer: Tokenizer) -> Path:
    """A Hugging Face model directory, as ``vllm serve --tokenizer`` is given one."""
    directory = tmp_path / "model"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    return directory


@pytest.mark.parametrize("make", [byte_level, metaspace], ids=["byte-level", "metaspace"])
def test_deltas_join_to_the_decode_of_the_whole_sequence(tmp_path: Path, make: Any) -> None:
    from kvpool.serve.detokenizer import IncrementalDetokenizer

    tokenizer = HfTokenizer(str(model_directory(tmp_path, make())))
    rng = random.Random(7)
    prompt = tokenizer.encode("the lazy dog")
    per_token_differs = 0
    for _ in range(200):
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 25))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        deltas = []
        for token_id in output:
            detokenizer.update([token_id])
            deltas.append(detokenizer.next_text(finished=False))
        detokenizer.finish()
        deltas.append(detokenizer.next_text(finished=True))
        context = prompt[-4:]
        whole = tokenizer.decode(context + output)[len(tokenizer.decode(context)) :]
        assert "".join(deltas) == whole
        per_token_differs += "".join(tokenizer.decode([t]) for t in output) != whole
    assert per_token_differs > 0  # the naive join is wrong for these tokenizers


def test_a_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(OSError, match=r"without tokenizer\.json"):
        HfTokenizer(str(tmp_path))


async def test_a_sentencepiece_model_streams_words_with_their_spaces(tmp_path: Path) -> None:
    """The text streamed over a socket is the decode of the ids; with a Metaspace
    tokenizer it has spaces (what benchmark tools count words and tokens by)."""
    tokenizer = HfTokenizer(str(model_directory(tmp_path, metaspace()) / "tokenizer.json"))
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    state = ServeState(config, speedup_ratio=0.0, tokenizer=tokenizer)
    prompt = "routers score workers by their queue"
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            stream = await client.completions.create(
                model="kvpool-mock", prompt=prompt, max_tokens=40, stream=True
            )
            deltas = [chunk.choices[0].text async for chunk in stream]
            plain = await client.completions.create(
                model="kvpool-mock", prompt=prompt, max_tokens=40
            )
            await client.close()
    streamed = "".join(deltas)
    assert streamed == plain.choices[0].text  # streamed or not, one text
    assert streamed.count(" ") >= 5  # words, not "wraprawerreally..."
    assert state.leaked_blocks == 0


def test_kvpool_serve_takes_a_model_directory(tmp_path: Path) -> None:
    directory = model_directory(tmp_path, byte_level())
    served = Served("--port", "0", "--tokenizer", str(directory), "--speedup-ratio", "0")
    try:
        body = {"prompt": "the quick brown fox", "max_tokens": 3}
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=GUARD_S)
        assert response.status_code == 200, response.text
        expected = len(HfTokenizer(str(directory)).encode("the quick brown fox", True))
        assert response.json()["usage"]["prompt_tokens"] == expected
    finally:
        status, log = served.stop()
    assert status == 0, log
    assert "Traceback" not in log


async def test_chunks_are_compact_json_with_a_real_tokenizer(tmp_path: Path) -> None:
    tokenizer = HfTokenizer(str(model_directory(tmp_path, byte_level())))
    config = EngineConfig(num_gpu_blocks=256, block_size=4, max_num_batched_tokens=256)
    state = ServeState(config, speedup_ratio=0.0, tokenizer=tokenizer)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
            response = await client.post("/v1/chat/completions", json={**body, "stream": True})
            plain = await client.post("/v1/chat/completions", json=body)
    text = ""
    for event in response.content.split(b"\n\n"):
        if event.startswith(b"data: {"):
            chunk = msgspec.json.decode(event[6:])
            text += chunk["choices"][0]["delta"].get("content") or ""
    assert text == plain.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("make", [byte_level, metaspace], ids=["byte-level", "metaspace"])
async def test_output_text_re_tokenizes_to_the_count_in_usage(tmp_path: Path, make: Any) -> None:
    """aiperf, guidellm and inference-perf count a response's output tokens by encoding
    its text with the same tokenizer: that count must be the ``usage`` the server sent
    (arbitrary ids, word pieces and byte fragments, re-encode to other counts). The
    requests are shaped as those tools send them."""
    directory = model_directory(tmp_path, make())
    tokenizer = HfTokenizer(str(directory))
    config = EngineConfig(num_gpu_blocks=512, block_size=4, max_num_batched_tokens=512)
    state = ServeState(config, speedup_ratio=0.0, tokenizer=tokenizer)
    counts: list[tuple[int, int, int]] = []  # (re-encoded, usage, asked)
    with anyio.fail_after(GUARD_S):
        async with running_server(state) as url:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            for i, wanted in enumerate((1, 7, 40, 90)):
                prompt = " ".join(CORPUS[i : i + 3])
                stream = await client.chat.completions.create(
                    model="kvpool-mock",
                    messages=[{"role": "user", "content": prompt}],
                    max_completion_tokens=wanted,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage = "", 0
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                counts.append((len(tokenizer.encode(text)), usage, wanted))
                plain = await client.completions.create(
                    model="kvpool-mock",
                    prompt=prompt,
                    max_tokens=wanted,
                    extra_body={"ignore_eos": True, "min_tokens": wanted},
                )
                assert plain.usage is not None
                re_encoded = len(tokenizer.encode(plain.choices[0].text))
                counts.append((re_encoded, plain.usage.completion_tokens, wanted))
            await client.close()
    assert all(re_encoded == usage == wanted for re_encoded, usage, wanted in counts), counts
    assert state.leaked_blocks == 0
