"""Text to token ids and back: a built-in deterministic tokenizer, or a local Hugging Face
tokenizer (a model directory holding ``tokenizer.json``, or the file itself) through the
optional ``tokenizers`` library.

The built-in one downloads nothing and needs no file: a word or punctuation mark is one
token whose id is a stable hash of it (xxh32, modulo `BUILTIN_VOCAB_SIZE`), so equal
texts give equal ids, and a shared text prefix gives a shared token prefix (what the
prefix cache needs). Decoding maps an id to a word of a fixed list: the mock engine's
generated ids become readable, deterministic text. It is not invertible (encoding
decoded text need not give the same ids back), which a mock server does not need.

The engine's output ids are arbitrary 32-bit numbers; `Tokenizer.output_id` maps them
into the vocabulary once, and every later use (text, ``stop_token_ids``, logprobs) sees
that id. A Hugging Face tokenizer maps them onto its whole-word tokens only (those whose
text re-encodes to themselves next to each other): benchmark tools (aiperf, guidellm,
inference-perf) count a response's output tokens by re-tokenizing its text, and a real
model's text re-tokenizes to about the count it generated, while arbitrary ids (word
pieces, byte fragments, special tokens) decode to text that does not.

Streamed text is decoded incrementally by `kvpool.serve.detokenizer`, never token by
token: a SentencePiece piece's leading space, or a UTF-8 character split over
byte-level tokens, only exists in the context of its neighbours.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Protocol

import xxhash

BUILTIN_VOCAB_SIZE = 32_000
"""Ids of the built-in tokenizer are below this (a Llama-sized vocabulary)."""

_PIECE = re.compile(r"\w+|[^\w\s]")
_WORDS = (  # noqa: SIM905 - a sentence reads better than 67 quoted words
    "the of and to in is that for it as was with be by on not he this are or his from "
    "at which but have an they you were her she there one all we their its more said "
    "will would about if what so when can who also no into time has two other than "
    "cache block token prefix router engine request stream pool model"
).split()


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    vocab_size: int
    """Output ids are below this."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of ``text`` (special tokens such as BOS only if asked)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of a run of ids in the vocabulary, decoded together."""
        ...

    def decode_token(self, token_id: int) -> str:
        """One id's text on its own (what logprobs show as a token)."""
        ...

    def output_id(self, engine_token: int) -> int:
        """The vocabulary id an engine output token (any int >= 0) stands for."""
        ...


class BuiltinTokenizer:
    """The default: deterministic, dependency-free, offline (see the module doc)."""

    vocab_size = BUILTIN_VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """One id per word or punctuation mark: ``xxh32(piece) % BUILTIN_VOCAB_SIZE``
        (there are no special tokens to add)."""
        return [
            xxhash.xxh32_intdigest(piece.encode()) % BUILTIN_VOCAB_SIZE
            for piece in _PIECE.findall(text)
        ]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The words of the ids, each with its leading space."""
        return "".join(self.decode_token(t) for t in token_ids)

    def decode_token(self, token_id: int) -> str:
        """``" " + word``, the word picked by the id from a fixed list."""
        return " " + _WORDS[token_id % len(_WORDS)]

    def output_id(self, engine_token: int) -> int:
        """``engine_token mod vocab_size``: every id decodes to a word already."""
        return engine_token % BUILTIN_VOCAB_SIZE


class HfTokenizer:
    """A local Hugging Face tokenizer (``pip install 'kvpool[serve]'``): a directory
    holding ``tokenizer.json`` (what ``vllm serve --tokenizer`` is given) or the file."""

    def __init__(self, path: str) -> None:
        """Load ``path``; raises ``ImportError`` without ``tokenizers``, ``OSError`` for a
        missing path or a directory without ``tokenizer.json`` (a slow-only tokenizer),
        and ``ValueError`` for a file that does not load. Nothing is downloaded."""
        try:
            from tokenizers import Tokenizer as _HfTokenizer
        except ImportError as exc:  # pragma: no cover - the serve extra installs it
            raise ImportError(
                "--tokenizer needs the tokenizers library: pip install 'kvpool[serve]'"
            ) from exc
        file = path
        if os.path.isdir(path):
            file = os.path.join(path, "tokenizer.json")
            if not os.path.isfile(file):
                raise FileNotFoundError(
                    f"{path!r} is a directory without tokenizer.json (only fast, "
                    "tokenizers-format tokenizers can be loaded)"
                )
        try:
            self._tokenizer = _HfTokenizer.from_file(file)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            if isinstance(exc, OSError):
                raise
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from exc
        self.vocab_size = max(1, self._tokenizer.get_vocab_size())
        self._words = self._round_trip_words()

    def _round_trip_words(self) -> list[int]:
        """The ids output may use: tokens whose text is one word (letters or digits,
        with at most the tokenizer's own leading space, and only those with it if it
        has any), that re-encode to themselves twice in a row, so that any
        sequence of them decodes to text that re-encodes to the same sequence (checked
        on all of them at once). Every id if the tokenizer has none such (e.g. a
        character-level vocabulary)."""
        every = list(range(self.vocab_size))
        texts = self._tokenizer.decode_batch([[t] for t in every])
        words = [t for t, text in zip(every, texts, strict=True) if _is_word(text)]
        if words:
            # a pair splits where one token would (a space-marking pre-tokenizer splits
            # before each word): the one-token check follows from it
            pairs = self._tokenizer.decode_batch([[t, t] for t in words])
            twice = self._tokenizer.encode_batch(pairs, add_special_tokens=False)
            words = [t for t, two in zip(words, twice, strict=True) if two.ids == [t, t]]
        # a byte-level tokenizer marks a word's start by a space of its own: its
        # unspaced words are pieces that merge with a preceding word
        spaced = [t for t in words if texts[t].startswith(" ")]
        for ids in (spaced, words):
            if ids and self.encode(self.decode(ids)) == ids:
                return ids
        return every

    def output_id(self, engine_token: int) -> int:
        """One of the round-trip word tokens, picked by ``engine_token``."""
        return self._words[engine_token % len(self._words)]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids for ``text`` (its post-processor's BOS/EOS only if asked)."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The tokenizer's decoder over the ids together."""
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def decode_token(self, token_id: int) -> str:
        """The tokenizer's text for ``token_id`` modulo its vocabulary size, alone."""
        return self.decode([token_id % self.vocab_size], skip_special_tokens=False)


def _is_word(text: str) -> bool:
    """A word of letters or digits, with at most one leading space."""
    word = text[1:] if text.startswith(" ") else text
    return word.isalnum()


def decode(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of several vocabulary ids, decoded together."""
    return tokenizer.decode(token_ids)


__all__ = [
    "BUILTIN_VOCAB_SIZE",
    "BuiltinTokenizer",
    "HfTokenizer",
    "Tokenizer",
    "decode",
]
