"""Trace block ids -> deterministic prompt token ids.

Block ``i`` of a request gets the tokens drawn from a counter-mode generator (numpy Philox)
keyed by the chained digest ``d_i = blake2b(d_{i-1} || id_i)``, ``d_{-1} = blake2b(namespace)``.
So an equal (namespace, id chain) prefix gives equal tokens in every process and run, and a
different chain gives different tokens with overwhelming probability, even if one id
re-appears after a divergence. A partial block is the prefix of the block's full tokens.
Prompt tokens past the hashed blocks (kv-cache-tester tails) are drawn from a key of the
request id, so they are unique to the request. Python ``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from deepinfer.bench.traces import TraceRequest

_DIGEST = 16


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"deepinfer-tokblk")
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


def namespace_digest(namespace: str) -> bytes:
    return _digest(b"ns", namespace.encode())


def chain_digests(namespace: str, block_ids: Sequence[int]) -> list[bytes]:
    """Chained digest of every block prefix of ``block_ids``."""
    d = namespace_digest(namespace)
    out = []
    for bid in block_ids:
        d = _digest(d, int(bid).to_bytes(16, "little", signed=True))
        out.append(d)
    return out


def draw_tokens(key: bytes, n: int, vocab_size: int, low: int = 0) -> np.ndarray:
    """``n`` token ids in ``[low, vocab_size)`` from the Philox stream keyed by ``key``."""
    k = np.frombuffer(key[:16], dtype="<u8").astype(np.uint64)
    gen = np.random.Generator(np.random.Philox(key=k))
    return gen.integers(low, vocab_size, size=n, dtype=np.int64)


class TokenBlocks:
    """Token factory for trace requests (caches recent blocks: shared prefixes are cheap)."""

    def __init__(self, vocab_size: int, *, low: int = 0, cache_blocks: int = 65536) -> None:
        if not 0 <= low < vocab_size:
            raise ValueError("need 0 <= low < vocab_size")
        self.vocab_size = vocab_size
        self.low = low
        self.cache_blocks = cache_blocks
        self._cache: OrderedDict[tuple[bytes, int], np.ndarray] = OrderedDict()

    def block(self, digest: bytes, block_size: int) -> np.ndarray:
        """Full tokens of the block with chained ``digest``."""
        key = (digest, block_size)
        arr = self._cache.get(key)
        if arr is not None:
            self._cache.move_to_end(key)
            return arr
        arr = draw_tokens(digest, block_size, self.vocab_size, self.low)
        self._cache[key] = arr
        if len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)
        return arr

    def request_array(self, req: TraceRequest) -> np.ndarray:
        """All ``req.input_length`` prompt tokens (``prefix_tokens`` if the trace has them)."""
        if req.prefix_tokens is not None and len(req.prefix_tokens) >= req.input_length:
            return np.asarray(req.prefix_tokens[: req.input_length], dtype=np.int64)
        bs, left = req.block_size, req.input_length
        parts = []
        for d in chain_digests(req.namespace, req.block_ids):
            if left <= 0:
                break
            n = min(bs, left)
            parts.append(self.block(d, bs)[:n])
            left -= n
        if left > 0:
            tail_key = _digest(b"tail", req.namespace.encode(), req.request_id.encode())
            parts.append(draw_tokens(tail_key, left, self.vocab_size, self.low))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def request_tokens(self, req: TraceRequest) -> list[int]:
        return self.request_array(req).tolist()
