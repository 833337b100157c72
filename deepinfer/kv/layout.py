"""What each layer caches per token: the shape every KV store (pool, tiers, codecs) is built from."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    """Per-token cache of one attention layer.

    ``components`` maps a name to the per-token shape, e.g. ``{"k": (kv_heads, head_dim),
    "v": (kv_heads, head_dim)}`` for GQA, or a single latent for MLA. ``window`` is the
    sliding window (None = full attention). ``share_with`` names an earlier layer whose cache
    this layer reads instead of owning one (cross-layer KV sharing).
    """

    components: tuple[tuple[str, tuple[int, ...]], ...]
    window: int | None = None
    share_with: int | None = None

    @staticmethod
    def gqa(kv_heads: int, head_dim: int, v_head_dim: int | None = None,
            window: int | None = None, share_with: int | None = None) -> KVSpec:
        return KVSpec((("k", (kv_heads, head_dim)), ("v", (kv_heads, v_head_dim or head_dim))),
                      window=window, share_with=share_with)

    @property
    def owns_cache(self) -> bool:
        return self.share_with is None

    def elements_per_token(self) -> int:
        return sum(math.prod(shape) for _, shape in self.components)


def describe(specs: list[KVSpec]) -> str:
    """Stable text of a layout; part of the cache namespace (a different layout never hits)."""
    parts = []
    for i, s in enumerate(specs):
        comps = ",".join(f"{n}{list(shape)}" for n, shape in s.components)
        parts.append(f"{i}:{comps}:w{s.window}:s{s.share_with}")
    return ";".join(parts)


def bytes_per_token(specs: list[KVSpec], bytes_per_element: float) -> float:
    """KV bytes one token occupies across all layers that own a cache."""
    return sum(s.elements_per_token() for s in specs if s.owns_cache) * bytes_per_element
