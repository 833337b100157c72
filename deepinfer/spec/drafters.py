"""Draft sources behind one interface, and the two weight-free ones.

A ``DraftSource`` proposes up to k tokens to follow each request of a step, with one feature
per position (a small integer the source knows, e.g. its match length), from which the
calibrator estimates the probability that the position survives verification. Weight-free
sources (``TokenDrafter``) draft from a request's token ids alone; the draft model
(``draft_model.py``) runs a model over the whole batch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..request import Request


@dataclass
class Draft:
    source: str
    tokens: list[int] = field(default_factory=list)
    features: list[int] = field(default_factory=list)  # one per token: the calibrator's bin key
    # q: row j is the distribution token j was drawn from (a draft model sampling); None: each
    # token is a point mass (weight-free sources, greedy drafting)
    probs: torch.Tensor | None = None

    def head(self, n: int) -> Draft:
        """The first ``n`` draft tokens."""
        return Draft(self.source, self.tokens[:n], self.features[:n],
                     None if self.probs is None else self.probs[:n])


class DraftSource(Protocol):
    name: str

    def propose_batch(self, items: list[tuple[Request, int]]) -> list[Draft]:
        """For each (request, k): up to k tokens to follow its tokens (fewer, or none, when the
        source has nothing)."""
        ...

    def finished(self, req: Request) -> None:
        """A request ended: learn from it, or free what was kept for it."""
        ...


class TokenDrafter:
    """A weight-free source: drafts from one request's token ids at a time."""

    name: str

    def propose(self, tokens: list[int], k: int) -> Draft:
        raise NotImplementedError

    def observe(self, tokens: list[int], start: int = 0) -> None:
        """Learn from a finished sequence's continuations at positions ``start`` on (sources
        without memory ignore it)."""

    def propose_batch(self, items: list[tuple[Request, int]]) -> list[Draft]:
        return [self.propose(req.all_token_ids, k) for req, k in items]

    def finished(self, req: Request) -> None:
        # a prefix served from the cache was computed, and learnt, by an earlier request (an
        # earlier turn): counting it again at every turn cost O(context) Python work on the
        # engine thread per finished request and weighted old turns once per later turn
        self.observe(req.all_token_ids, start=req.num_cached_tokens or 0)


class NgramDrafter(TokenDrafter):
    """Prompt lookup: the longest suffix of the sequence (length in [min_n, max_n]) that occurred
    earlier in the same sequence, continued by what followed its latest such occurrence.
    Feature: how far that match really extends (up to ``FEATURE_SPAN`` tokens, log-bucketed
    past ``max_n``): a reply copying a long stretch of its prompt matches far back, a common
    phrase only a few tokens, and the two are accepted at very different rates."""

    name = "ngram"
    FEATURE_SPAN = 32

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> Draft:
        arr = np.asarray(tokens, dtype=np.int64)
        L = len(arr)
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier positions holding the last token
        if len(ends) == 0:
            return Draft(self.name)
        length = np.ones(len(ends), dtype=np.int64)  # each candidate's match length
        alive = np.ones(len(ends), dtype=bool)
        for n in range(1, min(self.FEATURE_SPAN, L - 1)):
            back = ends - n
            alive &= (back >= 0) & (arr[np.maximum(back, 0)] == arr[L - 1 - n])
            if not alive.any():
                break
            length += alive
        capped = np.minimum(length, self.max_n)
        best = len(ends) - 1 - int(np.argmax(capped[::-1]))  # the latest of the longest
        if capped[best] < self.min_n:
            return Draft(self.name)
        end, n = int(ends[best]), int(length[best])
        cont = tokens[end + 1 : end + 1 + k]
        feature = n if n <= 4 else 2 + n.bit_length()  # 5-7: 5, 8-15: 6, 16-31: 7, 32: 8
        return Draft(self.name, cont, [feature] * len(cont))


class SuffixDrafter(TokenDrafter):
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

    def observe(self, tokens: list[int], start: int = 0) -> None:
        for i in range(max(1, start), len(tokens)):
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
