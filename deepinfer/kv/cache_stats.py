"""``CacheStats``: the KV cache manager's counters (hits, loads, evictions), which
``LLMEngine.stats()`` and the tiers' report (``tiers/report.py``) turn into fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from .radix import TIER_NAMES
from .tiers.backend import LoadStats


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # of which served from cache (vLLM's prefix_cache_hits)
    evicted_pages: int = 0  # pages evicted from L1
    preemptions: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens prefilled (recomputed ones included)
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    loads: int = 0  # finished loads from L2/L3 applied to a request
    loaded_pages: int = 0
    load_seconds: float = 0.0  # sum over loads of (queued -> data ready)
    load_seconds_max: float = 0.0
    load_failures: int = 0  # loads cut short by a page that could not be read
    load: LoadStats = field(default_factory=LoadStats)  # all loads: seconds and bytes by tier
    streamed_loads: int = 0  # layer-wise loads whose request started before they ended
    streamed_rewinds: int = 0  # of them, those with a page that failed after the forward
