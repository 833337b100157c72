"""Per-request benchmark records and the summary statistics of a run.

Times are seconds on one clock per run (``time.perf_counter()`` minus the run start).
Token hit rate = cached prompt tokens / prompt tokens; "prefill tokens computed" is the
prompt tokens that were not served from cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
TIER_ORDER = ("device", "host", "disk")  # as deepinfer.kv.radix.TIER_NAMES


def tier_key(name: str) -> tuple[int, str]:
    """Sort key: device, host, disk first, other tier names after, alphabetically."""
    return (TIER_ORDER.index(name) if name in TIER_ORDER else len(TIER_ORDER), name)


@dataclass
class RequestRecord:
    request_id: str
    session_id: str | None
    arrival_s: float  # when the request was sent / submitted
    first_token_s: float | None  # first output token arrived
    finish_s: float | None  # last output token arrived
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    ideal_cached_tokens: int | None = None
    cached_reported: bool = True  # False: the server said nothing about cached tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.first_token_s is None or self.finish_s is None or self.completion_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def percentiles(
    values: Sequence[float | None], ps: Sequence[int] = PERCENTILES
) -> dict[str, float | None]:
    """``{"p50": .., "p90": .., "p99": .., "mean": ..}`` (linear interpolation; None if empty)."""
    vals = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if vals.size == 0:
        return {**{f"p{p}": None for p in ps}, "mean": None}
    out: dict[str, float | None] = {f"p{p}": float(np.percentile(vals, p)) for p in ps}
    out["mean"] = float(vals.mean())
    return out


def summarize(
    records: Sequence[RequestRecord],
    *,
    ideal_hit_rate: float | None = None,
    bytes_by_tier: Mapping[str, int] | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """Summary of one config's run.

    ``ideal_hit_rate`` defaults to the records' ``ideal_cached_tokens`` (when all have one)
    over their prompt tokens. ``duration_s`` defaults to first arrival -> last finish.
    Errored requests count in ``num_errors`` only.
    """
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    tiers: dict[str, int] = {}
    for r in ok:
        for t, n in r.cached_by_tier.items():
            tiers[t] = tiers.get(t, 0) + n
    if ideal_hit_rate is None and ok and all(r.ideal_cached_tokens is not None for r in ok):
        ideal_hit_rate = sum(r.ideal_cached_tokens or 0 for r in ok) / prompt if prompt else 0.0
    reported = [r for r in ok if r.cached_reported]
    hit_rate: float | None = cached / prompt if prompt else 0.0
    if ok and not reported:  # e.g. a server that does not report cached tokens
        hit_rate = None
    if duration_s is None:
        duration_s = (
            max(r.finish_s for r in ok) - min(r.arrival_s for r in ok)  # type: ignore[type-var]
            if ok else 0.0
        )
    per_s = (lambda x: x / duration_s) if duration_s and duration_s > 0 else (lambda x: None)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": (prompt - cached) if hit_rate is not None else None,
        "cache_reported_fraction": (len(reported) / len(ok)) if ok else None,
        "completion_tokens": completion,
        "hit_rate": hit_rate,
        "hit_rate_by_tier": {t: (tiers[t] / prompt if prompt else 0.0)
                             for t in sorted(tiers, key=tier_key)},
        "cached_tokens_by_tier": {t: tiers[t] for t in sorted(tiers, key=tier_key)},
        "ideal_hit_rate": ideal_hit_rate,
        "achieved_over_ideal": (
            hit_rate / ideal_hit_rate if ideal_hit_rate and hit_rate is not None else None
        ),
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "tpot_s": percentiles([r.tpot_s for r in ok]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "prompt_tokens_per_s": per_s(prompt),
            "prefill_tokens_per_s": per_s(prompt - cached) if hit_rate is not None else None,
            "output_tokens_per_s": per_s(completion),
            "total_tokens_per_s": per_s(prompt + completion),
        },
        "bytes_by_tier": dict(bytes_by_tier) if bytes_by_tier is not None else None,
    }


def cumulative_hit_rate(records: Sequence[RequestRecord]) -> np.ndarray:
    """Hit rate of requests ``0..i`` for every i (records in arrival order, errors skipped)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.arrival_s)
    p = np.cumsum([r.prompt_tokens for r in ok], dtype=np.float64)
    c = np.cumsum([r.cached_tokens for r in ok], dtype=np.float64)
    return np.divide(c, p, out=np.zeros_like(c), where=p > 0)
