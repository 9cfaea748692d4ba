"""Text to token ids and back: a built-in deterministic tokenizer, or a local Hugging Face
``tokenizer.json`` through the optional ``tokenizers`` library.

The built-in one downloads nothing and needs no file: a word or punctuation mark is one
token whose id is a stable hash of it (xxh32, modulo `BUILTIN_VOCAB_SIZE`), so equal
texts give equal ids, and a shared text prefix gives a shared token prefix (what the
prefix cache needs). Decoding maps an id to a word of a fixed list: the mock engine's
generated ids become readable, deterministic text. It is not invertible (encoding
decoded text need not give the same ids back), which a mock server does not need.
"""

from __future__ import annotations

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

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        ...

    def decode_token(self, token_id: int) -> str:
        """The text one generated token adds to the output (leading space included)."""
        ...


class BuiltinTokenizer:
    """The default: deterministic, dependency-free, offline (see the module doc)."""

    def encode(self, text: str) -> list[int]:
        """One id per word or punctuation mark: ``xxh32(piece) % BUILTIN_VOCAB_SIZE``."""
        return [
            xxhash.xxh32_intdigest(piece.encode()) % BUILTIN_VOCAB_SIZE
            for piece in _PIECE.findall(text)
        ]

    def decode_token(self, token_id: int) -> str:
        """``" " + word``, the word picked by the id from a fixed list."""
        return " " + _WORDS[token_id % len(_WORDS)]


class HfTokenizer:
    """A local Hugging Face ``tokenizer.json`` (``pip install 'kvpool[serve]'``)."""

    def __init__(self, path: str) -> None:
        """Load ``path``; raises ``ImportError`` without ``tokenizers`` and ``ValueError``
        (``OSError`` for a missing file) if it cannot be loaded. Nothing is downloaded."""
        try:
            from tokenizers import Tokenizer as _HfTokenizer
        except ImportError as exc:  # pragma: no cover - the serve extra installs it
            raise ImportError(
                "--tokenizer needs the tokenizers library: pip install 'kvpool[serve]'"
            ) from exc
        try:
            self._tokenizer = _HfTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            if isinstance(exc, OSError):
                raise
            raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from exc
        self._vocab_size = max(1, self._tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text``, without special tokens."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode_token(self, token_id: int) -> str:
        """The tokenizer's text for ``token_id`` modulo its vocabulary size."""
        text: str = self._tokenizer.decode([token_id % self._vocab_size])
        return text


def decode(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of several generated tokens, in order."""
    return "".join(tokenizer.decode_token(t) for t in token_ids)


__all__ = ["BUILTIN_VOCAB_SIZE", "BuiltinTokenizer", "HfTokenizer", "Tokenizer", "decode"]
