"""Token sequences as runs of consecutive ids, and cheap chained block keys computed from
the runs without building a token.

A workload's prompt is a list of segments whose tokens are ``(seed + j) mod 2**32``
(`kvpool.workloads.spec`): a run. `TokenRuns` carries such a sequence as its runs, so a
caller can hand a 4,000-token prompt over as a few pairs of ints. With KV events off no
hash leaves the process, so a block needs a name that is equal exactly when its tokens
and its whole prefix are, not Dynamo's name: `kvpool.hashing.run_keys.RunKeyer` keys
the blocks of one run in closed form (one digest of the parent key and the start token,
then consecutive keys) and a block of several runs by one digest of the parent key and
its maximal runs (a token sequence has one decomposition into maximal runs of
consecutive ids, so equal blocks get equal descriptions however the runs were cut).

Keys are not Dynamo's hashes: a manager uses one scheme or the other, never both
(`kvpool.manager.KvManager`'s ``run_keys``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

from kvpool.errors import InvalidArgumentError
from kvpool.hashing.block_hash import TOKEN_TYPECODE

TOKEN_MASK = (1 << 32) - 1


class TokenRuns(Sequence[int]):
    """A token sequence held as runs ``(start, length)``: tokens ``(start + j) mod 2**32``
    for ``j < length``, run after run. Immutable; a `Sequence` of its tokens, so any
    caller that takes token ids takes it (indexing builds a token; `to_array` all)."""

    __slots__ = ("_tokens", "num_tokens", "runs")

    def __init__(
        self, runs: Sequence[tuple[int, int]], *, tokens: array[int] | None = None
    ) -> None:
        """Raises `InvalidArgumentError` unless each run is a pair of ints, a start in
        ``[0, 2**32)`` and a length ``>= 0`` (empty runs are dropped). ``tokens``, if
        given, must be the runs' tokens as a u32 array, built already (a workload's
        cached segments): `to_array` then copies it instead of building them."""
        kept: list[tuple[int, int]] = []
        total = 0
        for run in runs:
            if type(run) is not tuple or len(run) != 2:
                raise InvalidArgumentError(f"a token run must be (start, length), got {run!r}")
            start, length = run
            if type(start) is not int or not 0 <= start <= TOKEN_MASK:
                raise InvalidArgumentError(f"a run's start must be a u32 token, got {start!r}")
            if type(length) is not int or length < 0:
                raise InvalidArgumentError(f"a run's length must be an int >= 0, got {length!r}")
            if length:
                kept.append(run)
                total += length
        self.runs: tuple[tuple[int, int], ...] = tuple(kept)
        self.num_tokens = total
        """How many tokens (what ``len`` answers: compiled callers read it, as a call of
        this interpreted class's ``__len__`` costs them more)."""
        if tokens is not None and len(tokens) != total:
            raise InvalidArgumentError(f"{len(tokens)} tokens given for runs of {total}")
        self._tokens = tokens

    @classmethod
    def of_checked(
        cls, runs: tuple[tuple[int, int], ...], length: int, tokens: array[int] | None = None
    ) -> TokenRuns:
        """The runs of a caller that holds them checked already (each a u32 start and a
        length >= 1, ``length`` their sum, ``tokens`` None or their tokens): what the
        constructor makes of them, without reading them again (a workload's prompt, whose
        segments were checked when it was read)."""
        made = cls.__new__(cls)
        made.runs = runs
        made.num_tokens = length
        made._tokens = tokens
        return made

    @classmethod
    def from_tokens(cls, tokens: Sequence[int]) -> TokenRuns:
        """The maximal runs of already-validated u32 ``tokens`` (one pass over them)."""
        runs: list[tuple[int, int]] = []
        start = -1
        length = 0
        expect = -1
        for token in tokens:
            if token == expect:
                length += 1
            else:
                if length:
                    runs.append((start, length))
                start, length = token, 1
            expect = (token + 1) & TOKEN_MASK
        if length:
            runs.append((start, length))
        return cls(runs)

    def __len__(self) -> int:
        return self.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self.to_array()[index].tolist()
        if index < 0:
            index += self.num_tokens
        if not 0 <= index < self.num_tokens:
            raise IndexError("token index out of range")
        for start, length in self.runs:
            if index < length:
                return (start + index) & TOKEN_MASK
            index -= length
        raise AssertionError("unreachable")  # pragma: no cover

    def __iter__(self) -> Iterator[int]:
        for start, length in self.runs:
            for j in range(length):
                yield (start + j) & TOKEN_MASK

    def __repr__(self) -> str:
        return f"TokenRuns({list(self.runs)!r})"

    def to_array(self) -> array[int]:
        """The tokens as a fresh ``u32`` array (`TOKEN_TYPECODE`)."""
        if self._tokens is not None:
            return array(TOKEN_TYPECODE, self._tokens)
        tokens = array(TOKEN_TYPECODE)
        for start, length in self.runs:
            if start + length <= TOKEN_MASK + 1:
                tokens.extend(range(start, start + length))
            else:
                tokens.extend((start + j) & TOKEN_MASK for j in range(length))
        return tokens


__all__ = ["TOKEN_MASK", "TokenRuns"]
