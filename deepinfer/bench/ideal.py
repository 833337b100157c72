"""Ideal (infinite-cache) prefix hit rate of a block trace.

Each request, in arrival order, hits on its longest run of leading blocks whose whole chain
(namespace, id_0, ..., id_i) was part of some earlier request; it then adds its own chain.
Hits count tokens: a block contributes its real token count (a partial last block counts
what it holds), capped by the most tokens any earlier request held in that block, and the
run stops after a block that was only partly seen. A chain that diverges and later uses an
id seen elsewhere (re-convergence) is not a hit: the key is the chain, not the id.

The index is a compressed trie over block ids (runs split where chains diverge), so a long
shared prefix is matched with one list comparison; no token lists are built. The Mooncake
conversation trace (12 K requests, 145 M tokens, 283 K blocks) takes well under a second.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer.bench.traces import TraceRequest


@dataclass
class IdealResult:
    input_tokens: np.ndarray  # per request, arrival order
    hit_tokens: np.ndarray  # per request
    unique_blocks: int
    seconds: float

    @property
    def total_input_tokens(self) -> int:
        return int(self.input_tokens.sum())

    @property
    def total_hit_tokens(self) -> int:
        return int(self.hit_tokens.sum())

    @property
    def hit_rate(self) -> float:
        total = self.total_input_tokens
        return self.total_hit_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        return {
            "requests": int(len(self.input_tokens)),
            "input_tokens": self.total_input_tokens,
            "ideal_hit_tokens": self.total_hit_tokens,
            "ideal_hit_rate": self.hit_rate,
            "unique_blocks": self.unique_blocks,
            "seconds": self.seconds,
        }


class _Run:
    """A run of chained blocks that no request has split: ids and per-block seen tokens."""

    __slots__ = ("ids", "counts", "children")

    def __init__(self, ids: list[int], counts: list[int]) -> None:
        self.ids = ids
        self.counts = counts  # most tokens any request held in each block
        self.children: dict[int, _Run] = {}


class IdealIndex:
    """Incremental infinite cache: ``lookup_insert`` one request at a time.

    A compressed trie (runs of block ids, split where chains diverge, extended in place when
    a request continues a leaf), so matching a long shared prefix is one list comparison.
    """

    def __init__(self) -> None:
        self._roots: dict[str, _Run] = {}
        self.num_blocks = 0

    def lookup_insert(
        self, namespace: str, block_ids: Sequence[int], block_size: int, input_length: int
    ) -> int:
        """Hit tokens of this request against all earlier ones; then record it."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Run([], [])
        bs = block_size
        nb = min(len(block_ids), -(-input_length // bs)) if input_length > 0 else 0
        if nb == 0:
            return 0
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        last_n = min(bs, input_length - (nb - 1) * bs)  # tokens in the last hashed block
        node, i, hits, matching = root, 0, 0, True
        while i < nb:
            child = node.children.get(ids[i])
            if child is None:
                break
            run = child.ids
            m = min(len(run), nb - i)
            if ids[i : i + m] == (run if m == len(run) else run[:m]):
                c = m
            else:
                c = 1
                while run[c] == ids[i + c]:
                    c += 1
            cnts = child.counts
            need_last = last_n if i + c == nb else bs
            if (c == 1 or min(cnts[: c - 1]) >= bs) and cnts[c - 1] >= need_last:
                if matching:
                    hits += (c - 1) * bs + need_last
            else:  # some block of this run was only partly seen (partial last blocks)
                for k in range(c):
                    need = bs if i + k < nb - 1 else last_n
                    have = cnts[k]
                    if matching:
                        hits += min(have, need)
                        matching = have >= need
                    if have < need:
                        cnts[k] = need
            i += c
            if c < len(run):
                if i < nb:
                    node = self._split(child, c)
                break
            node = child
        if i < nb:
            rest = ids[i:nb]
            counts = [bs] * (nb - i)
            counts[-1] = last_n
            self.num_blocks += nb - i
            if node is not root and not node.children:
                node.ids.extend(rest)  # a request continuing a leaf: grow the run
                node.counts.extend(counts)
            else:
                node.children[rest[0]] = _Run(rest, counts)
        return hits

    @staticmethod
    def _split(node: _Run, k: int) -> _Run:
        """Keep the first ``k`` blocks in ``node`` (the parent's child); returns it."""
        lower = _Run(node.ids[k:], node.counts[k:])
        lower.children = node.children
        node.ids = node.ids[:k]
        node.counts = node.counts[:k]
        node.children = {lower.ids[0]: lower}
        return node


def ideal_hits(requests: Iterable[TraceRequest]) -> IdealResult:
    """Per-request ideal hit tokens of ``requests`` taken in the given (arrival) order."""
    t0 = time.perf_counter()
    idx = IdealIndex()
    inputs, hits = array("q"), array("q")
    for r in requests:
        inputs.append(r.input_length)
        hits.append(idx.lookup_insert(r.namespace, r.block_ids, r.block_size, r.input_length))
    return IdealResult(
        input_tokens=np.frombuffer(inputs, dtype=np.int64).copy(),
        hit_tokens=np.frombuffer(hits, dtype=np.int64).copy(),
        unique_blocks=idx.num_blocks,
        seconds=time.perf_counter() - t0,
    )


def ideal_hit_rate(requests: Iterable[TraceRequest]) -> float:
    return ideal_hits(requests).hit_rate


def token_block_ids(tokens: Sequence[int], block_size: int) -> list[int]:
    """Block ids of a real token list (for workloads with real prompts).

    Ids are content hashes of each block's tokens (partial last block included), chaining is
    done by the ideal index itself, so equal token prefixes give equal id chains.
    """
    out = []
    for i in range(0, len(tokens), block_size):
        h = hashlib.blake2b(
            array("q", tokens[i : i + block_size]).tobytes(), digest_size=8, person=b"di-ideal"
        )
        out.append(int.from_bytes(h.digest(), "little"))
    return out


def ideal_hits_tokens(
    prompts: Iterable[Sequence[int]], block_size: int, namespace: str = ""
) -> IdealResult:
    """Ideal hits of real token prompts (in order) at ``block_size`` granularity."""
    reqs = (
        TraceRequest(
            arrival_s=0.0,
            session_id=None,
            block_ids=token_block_ids(p, block_size),
            block_size=block_size,
            input_length=len(p),
            output_length=0,
            namespace=namespace,
        )
        for p in prompts
    )
    return ideal_hits(reqs)
