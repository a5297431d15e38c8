"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the
context's last n-gram (the n-gram speculation transformers and vLLM ship; no extra model).

A proposal is only a guess: the compressed-KV drafter (VeriCache) or the exact verifier
(the full-KV baseline) checks it, several tokens per forward, and only verified tokens are
emitted. Long prompts (documents, code) repeat themselves, and outputs quote them, so the
guesses are often long and right.

The index of a prefix's n-grams is built once and shared by every request over it
(`NgramTable`); each request adds its own tokens (suffix, then output) in a small overlay
(`NgramProposer`), consulted first, so the latest occurrence wins.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_N = 3
"""Longest n-gram matched (longer matches are tried first)."""


class NgramTable:
    """For n = 1..MAX_N: the n-grams of a token sequence, each mapped to where the token
    after its latest occurrence sits."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_N)]
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, indexing each n-gram once the token after it is known."""
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows grams ending at end-1
            self.tokens.append(int(token))
            self._index(end)

    def _index(self, end: int) -> None:
        for n in range(1, MAX_N + 1):
            if end - n >= 0:
                self._next[n - 1][tuple(self.tokens[end - n : end])] = end

    def follower(self, gram: tuple[int, ...]) -> int | None:
        """Index of the token after the latest indexed occurrence of `gram`, or None."""
        return self._next[len(gram) - 1].get(gram)


class NgramProposer:
    """A request's proposals: its prefix's shared table plus its own tokens."""

    def __init__(self, prefix: NgramTable, own: Sequence[int] = ()) -> None:
        self.prefix = prefix
        self._own = NgramTable()
        self._own_start = len(prefix.tokens)
        # Grams that end in the prefix but are followed by the request's first token are
        # indexed in the overlay (the prefix's table cannot know that token).
        self._own.tokens = prefix.tokens[-(MAX_N):]
        self._offset = self._own_start - len(self._own.tokens)
        self.extend(own)

    def extend(self, tokens: Sequence[int]) -> None:
        """The request's next context tokens (its suffix, then each emitted token)."""
        self._own.extend(tokens)

    def __len__(self) -> int:
        return self._offset + len(self._own.tokens)

    def propose(self, drafts: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens expected after the context followed by `drafts` (tokens drafted
        since the context's last verified one, not yet part of it)."""
        if k <= 0:
            return []
        tail = [*self._own.tokens[-MAX_N:], *drafts][-MAX_N:]
        for n in range(len(tail), 0, -1):
            gram = tuple(tail[-n:])
            start = self._own.follower(gram)
            if start is not None:
                return self._own.tokens[start : start + k]
            start = self.prefix.follower(gram)
            if start is not None:
                return self._continuation(start, k)
        return []

    def _continuation(self, start: int, k: int) -> list[int]:
        """k tokens of the whole context from index `start` (in the prefix)."""
        out = self.prefix.tokens[start : min(start + k, self._own_start)]
        if len(out) < k:
            own_from = self._own_start - self._offset
            out += self._own.tokens[own_from : own_from + k - len(out)]
        return out
