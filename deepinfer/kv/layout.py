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

    ``tokens_per_entry`` > 1: one entry per that many tokens (compressed KV, e.g. DeepSeek-V4's
    CSA/HCA), stored in the page of the token that closes its run; a page then holds
    ``ceil(page_size / tokens_per_entry)`` rows. ``feeds_pages`` (window specs): the ring holds
    inputs of paged state (V4's compressor inputs), so a replay that starts with an empty ring
    would recompute that state wrongly; only a snapshot, or a replay from position 0, is exact.
    """

    components: tuple[tuple[str, tuple[int, ...]], ...]
    window: int | None = None
    share_with: int | None = None
    tokens_per_entry: int = 1
    feeds_pages: bool = False

    @staticmethod
    def gqa(kv_heads: int, head_dim: int, v_head_dim: int | None = None,
            window: int | None = None, share_with: int | None = None) -> KVSpec:
        return KVSpec((("k", (kv_heads, head_dim)), ("v", (kv_heads, v_head_dim or head_dim))),
                      window=window, share_with=share_with)

    @property
    def owns_cache(self) -> bool:
        return self.share_with is None

    def elements_per_token(self) -> int:
        """Elements of one entry (of one token when ``tokens_per_entry`` is 1)."""
        return sum(math.prod(shape) for _, shape in self.components)

    def rows_per_page(self, page_size: int) -> int:
        return -(-page_size // self.tokens_per_entry)

    def elements_per_page(self, page_size: int) -> int:
        return self.rows_per_page(page_size) * self.elements_per_token()


def describe(specs: list[KVSpec]) -> str:
    """Stable text of a layout; part of the cache namespace (a different layout never hits)."""
    parts = []
    for i, s in enumerate(specs):
        comps = ",".join(f"{n}{list(shape)}" for n, shape in s.components)
        stride = f":e{s.tokens_per_entry}" if s.tokens_per_entry != 1 else ""
        parts.append(f"{i}:{comps}:w{s.window}:s{s.share_with}{stride}")
    return ";".join(parts)


def bytes_per_token(specs: list[KVSpec], bytes_per_element: float, page_size: int) -> float:
    """KV bytes one token occupies across all layers that own a cache (pages of ``page_size``)."""
    return sum(s.elements_per_page(page_size) for s in specs if s.owns_cache) * bytes_per_element / page_size
