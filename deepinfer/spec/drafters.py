"""Weight-free draft sources behind one interface.

A ``Drafter`` proposes up to k tokens to follow a sequence, with one feature per position (a
small integer the source knows, e.g. its match length), from which the calibrator estimates the
probability that the position survives verification.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class Draft:
    source: str
    tokens: list[int] = field(default_factory=list)
    features: list[int] = field(default_factory=list)  # one per token: the calibrator's bin key


class Drafter(Protocol):
    name: str

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Up to ``k`` tokens to follow ``tokens`` (fewer, or none, when the source has nothing)."""
        ...

    def observe(self, tokens: list[int]) -> None:
        """Learn from a finished sequence (sources without memory ignore it)."""
        ...


class NgramDrafter:
    """Prompt lookup: the longest suffix of the sequence (length in [min_n, max_n]) that occurred
    earlier in the same sequence, continued by what followed its latest such occurrence.
    Feature: the match length."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> Draft:
        arr = np.asarray(tokens, dtype=np.int64)
        L = len(arr)
        best_len, best_end = 0, -1
        # candidate ends: earlier positions holding the last token, latest first
        for end in np.flatnonzero(arr[:-1] == arr[-1])[::-1]:
            n = 1
            while n < self.max_n and end - n >= 0 and arr[end - n] == arr[L - 1 - n]:
                n += 1
            if n > best_len:
                best_len, best_end = n, int(end)
                if n == self.max_n:
                    break
        if best_len < self.min_n:
            return Draft(self.name)
        cont = tokens[best_end + 1 : best_end + 1 + k]
        return Draft(self.name, cont, [best_len] * len(cont))

    def observe(self, tokens: list[int]) -> None:
        return None


class SuffixDrafter:
    """A continuation index shared by all requests: for every context of 1..max_n tokens seen in
    finished sequences (other requests, earlier turns), how often each next token followed it.
    A draft follows the most frequent continuation of the longest known context of the current
    sequence, step by step. Feature: that continuation's share of the context's count, in
    quarters (0-4), plus 5 x (context length - 1)."""

    name = "suffix"

    def __init__(self, min_n: int, max_n: int, max_contexts: int = 1 << 20) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.max_contexts = max_contexts
        self.next: OrderedDict[tuple[int, ...], Counter[int]] = OrderedDict()

    def observe(self, tokens: list[int]) -> None:
        for i in range(1, len(tokens)):
            for n in range(1, min(self.max_n, i) + 1):
                ctx = tuple(tokens[i - n : i])
                counts = self.next.get(ctx)
                if counts is None:
                    counts = self.next[ctx] = Counter()
                else:
                    self.next.move_to_end(ctx)
                counts[tokens[i]] += 1
        while len(self.next) > self.max_contexts:  # least recently seen contexts go first
            self.next.popitem(last=False)

    def propose(self, tokens: list[int], k: int) -> Draft:
        draft = Draft(self.name)
        seq = list(tokens[-self.max_n :])
        while len(draft.tokens) < k:
            step = self._next(seq)
            if step is None:
                break
            tok, feature = step
            draft.tokens.append(tok)
            draft.features.append(feature)
            seq = seq[1:] + [tok] if len(seq) >= self.max_n else seq + [tok]
        return draft

    def _next(self, seq: list[int]) -> tuple[int, int] | None:
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            counts = self.next.get(tuple(seq[-n:]))
            if counts:
                tok, c = counts.most_common(1)[0]
                return tok, round(4 * c / sum(counts.values())) + 5 * (n - 1)
        return None


def make_drafter(method: str, min_n: int, max_n: int) -> Drafter:
    return NgramDrafter(min_n, max_n) if method == "ngram" else SuffixDrafter(min_n, max_n)
