"""Capacity planner, sweep: replay a trace over a grid of L1 / L2 / L3 capacities and page sizes
and find the smallest sizes that reach a target hit rate (``plan``)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepinfer.bench.replay import (DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_NODE_PAGES, ReplayResult,
                                    block_digests, replay)
from deepinfer.bench.traces import TraceRequest
from deepinfer.kv.tiers.policy import WRITE_THROUGH


@dataclass
class PlanReport:
    trace: str
    requests: int
    input_tokens: int
    trace_ideal_hit_rate: float  # block granularity, infinite cache (bench/ideal.py)
    target: float | None
    points: list[ReplayResult]
    unbounded: dict[int, ReplayResult]  # per page size: infinite L1 (this engine's ideal)
    smallest: dict[int, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "trace_ideal_hit_rate": self.trace_ideal_hit_rate,
            "unbounded": {str(ps): r.as_dict() for ps, r in self.unbounded.items()},
            "target": self.target,
            "smallest": {str(ps): s for ps, s in self.smallest.items()},
            "points": [p.as_dict() for p in self.points],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanReport:
        """Back from ``plan.json`` (to re-plot or compare runs)."""
        return cls(
            trace=d["trace"], requests=d["requests"], input_tokens=d["input_tokens"],
            trace_ideal_hit_rate=d["trace_ideal_hit_rate"], target=d["target"],
            points=[ReplayResult.from_dict(p) for p in d["points"]],
            unbounded={int(k): ReplayResult.from_dict(v) for k, v in d["unbounded"].items()},
            smallest={int(k): v for k, v in d["smallest"].items()}, meta=d.get("meta", {}))


def parse_tokens(s: str) -> int:
    """``"1M"``, ``"200m"``, ``"64k"``, ``"1.5G"``, ``"4096"`` -> tokens (decimal units)."""
    s = s.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(s[-1:], 1)
    num = s[:-1] if mult != 1 else s
    return round(float(num) * mult)


def format_tokens(n: int | None) -> str:
    """``2M``, ``1.5M``, ``64k``; other sizes with thousands separators."""
    if n is None:
        return "inf"
    for unit, v in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= v:
            if (n * 100) % v == 0:
                return f"{n / v:g}{unit}"
            break
    return f"{n:,}"


def log_grid(lo: int, hi: int, n: int) -> list[int]:
    """``n`` capacities from ``lo`` to ``hi`` evenly spaced on a log scale, rounded to two
    significant digits (1M, 1.6M, 2.6M, ...)."""
    if n <= 1 or lo == hi:
        return [lo]
    out = set()
    for x in np.geomspace(lo, hi, n):
        e = 10 ** max(0, math.floor(math.log10(x)) - 1)
        out.add(round(x / e) * e)
    return sorted(out)


def smallest_sizes(points: Sequence[ReplayResult], target: float) -> dict[str, Any]:
    """Smallest grid sizes reaching ``target`` at one page size.

    ``l1_only``: the least L1 (no L2 / L3) reaching it; ``pareto``: every (L1, L2, L3) that
    reaches it with no other reaching point at most as large in every tier.
    """
    ok = [p for p in points if p.hit_rate >= target and p.failed_requests == 0]
    l1 = [p for p in ok if p.l2_tokens == 0 and p.l3_tokens == 0 and p.l1_tokens is not None]
    best = min(l1, key=lambda p: p.l1_tokens) if l1 else None  # type: ignore[arg-type,return-value]
    sizes = {(p.l1_tokens, p.l2_tokens, p.l3_tokens): p for p in ok if p.l1_tokens is not None}
    pareto = []
    for key, p in sizes.items():
        dominated = any(o != key and all(a <= b for a, b in zip(o, key)) for o in sizes)
        if not dominated:
            pareto.append({"l1_tokens": key[0], "l2_tokens": key[1], "l3_tokens": key[2],
                           "hit_rate": p.hit_rate})
    pareto.sort(key=lambda d: (d["l1_tokens"], d["l2_tokens"], d["l3_tokens"]))
    return {
        "target": target,
        "l1_only": None if best is None else {"l1_tokens": best.l1_tokens,
                                              "hit_rate": best.hit_rate},
        "pareto": pareto,
    }


def refine_l1(trace: Sequence[TraceRequest], target: float, lo: int, hi: int, *,
              page_size: int, tolerance: float = 0.02, max_steps: int = 12,
              **kw: Any) -> tuple[int, float, list[ReplayResult]]:
    """Bisect L1 (pages) between ``lo`` (misses ``target``) and ``hi`` (reaches it).

    Assumes the hit rate grows with capacity (LRU over a prefix tree almost always does;
    the grid shows it). Stops when ``hi / lo - 1 <= tolerance``. Returns (L1 tokens reaching
    the target, its hit rate, the points evaluated).
    """
    ps = page_size
    lo_p, hi_p = lo // ps, hi // ps
    evaluated = []
    best_rate = None
    for _ in range(max_steps):
        if hi_p - lo_p <= 1 or hi_p <= lo_p * (1 + tolerance):
            break
        mid = (lo_p + hi_p) // 2
        r = replay(trace, page_size=ps, l1_tokens=mid * ps, **kw)
        evaluated.append(r)
        if r.hit_rate >= target and r.failed_requests == 0:
            hi_p, best_rate = mid, r.hit_rate
        else:
            lo_p = mid
    return hi_p * ps, best_rate if best_rate is not None else float("nan"), evaluated


def plan(
    trace: Sequence[TraceRequest],
    *,
    page_sizes: Iterable[int] = (512,),
    l1: Iterable[int],
    l2: Iterable[int] = (0,),
    l3: Iterable[int] = (0,),
    target: float | None = None,
    target_of_ideal: float | None = None,
    refine: bool = False,
    name: str = "trace",
    progress: bool = True,
    **kw: Any,
) -> PlanReport:
    """Replay ``trace`` at every (page size, L1, L2, L3) of the grid, plus unbounded L1.

    ``target`` (a hit rate) or ``target_of_ideal`` (a fraction of the trace's ideal hit rate)
    selects the smallest sizes reaching it (``refine``: bisect L1 between grid points).
    """
    from tqdm import tqdm

    from deepinfer.bench.ideal import ideal_hits

    t0 = time.perf_counter()
    digests = [block_digests(r) for r in trace]
    prep_s = time.perf_counter() - t0
    ideal = ideal_hits(trace)
    if target is None and target_of_ideal is not None:
        target = target_of_ideal * ideal.hit_rate
    else:
        target_of_ideal = None
    grid = [(ps, a, b, c) for ps in page_sizes for a in l1 for b in l2 for c in l3]
    page_list = sorted({g[0] for g in grid})
    bar = tqdm(total=len(grid) + len(page_list), desc=f"plan {name}", unit="pt",
               disable=not progress)
    unbounded = {}
    for ps in page_list:
        unbounded[ps] = replay(trace, page_size=ps, l1_tokens=None, digests=digests, **kw)
        bar.update(1)
    points = []
    for ps, a, b, c in grid:
        points.append(replay(trace, page_size=ps, l1_tokens=a, l2_tokens=b, l3_tokens=c,
                             digests=digests, **kw))
        bar.set_postfix_str(f"P{ps} L1 {format_tokens(a)}: {100 * points[-1].hit_rate:.1f}%")
        bar.update(1)
    bar.close()
    smallest: dict[int, dict[str, Any]] = {}
    if target is not None:
        for ps in page_list:
            pts = [p for p in points if p.page_size == ps]
            s = smallest_sizes(pts, target)
            if refine and s["l1_only"] is not None:
                l1s = sorted(p.l1_tokens for p in pts  # type: ignore[misc]
                             if p.l2_tokens == 0 and p.l3_tokens == 0)
                hi = s["l1_only"]["l1_tokens"]
                below = [x for x in l1s if x < hi]
                if below:
                    tok, rate, extra = refine_l1(trace, target, below[-1], hi, page_size=ps,
                                                 digests=digests, **kw)
                    points.extend(extra)
                    if not math.isnan(rate):
                        s["l1_only_refined"] = {"l1_tokens": tok, "hit_rate": rate}
            smallest[ps] = s
    return PlanReport(
        trace=name, requests=len(trace), input_tokens=sum(r.input_length for r in trace),
        trace_ideal_hit_rate=ideal.hit_rate, target=target, points=points, unbounded=unbounded,
        smallest=smallest,
        meta={"prepare_seconds": prep_s, "total_seconds": time.perf_counter() - t0,
              "concurrency": kw.get("concurrency", 1),
              "chunk_tokens": kw.get("chunk_tokens", DEFAULT_CHUNK_TOKENS),
              "max_node_pages": kw.get("max_node_pages", DEFAULT_MAX_NODE_PAGES),
              "outputs": kw.get("outputs", True),
              "target_of_ideal": target_of_ideal,
              "tier_policy": kw.get("policy", WRITE_THROUGH)
              if any(p.tier_policy for p in points) else None})
