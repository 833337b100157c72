"""Aggregates ``benchmarks/router.py``'s runs: per (workload, config), the rounds pooled, with a
spread, so a TTFT difference between policies can be told from one run's noise.

Hit rate: cached over prompt tokens of all rounds' requests (and each round's), and per tier
that served them (a ``/pool`` config's store hits are its workers' L3, "disk"). TTFT p50/p90:
of all rounds' requests, with a 90% bootstrap interval (requests resampled with replacement,
a fixed seed: the same runs give the same interval). A config is compared with round_robin by
the ratio of their TTFT p50s, its interval bootstrapped *paired*: both configs served the same
requests (same round, same session and turn), so one resample draws request keys and takes
both configs' TTFTs of those keys; a first turn (cold, slow) is then never compared with a
later one (a hit, fast) by chance of the draw. Below 1 at its upper end is a win, above 1 at
its lower end a loss, else not decided.
"""

from __future__ import annotations

import numpy as np

BOOT = 2000  # resamples
LEVEL = 0.90


def _resampled(values: list[float], q: float, rng: np.random.Generator) -> np.ndarray:
    """The ``q``-th percentile of ``BOOT`` resamples of ``values``."""
    v = np.asarray(values, dtype=np.float64)
    idx = rng.integers(0, v.size, size=(BOOT, v.size))
    return np.percentile(v[idx], q, axis=1)


def interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def percentile_ci(values: list[float], q: float, seed: int = 0) -> tuple[float, float, float]:
    """(the ``q``-th percentile of ``values``, its bootstrap interval)."""
    rng = np.random.default_rng(seed)
    return (float(np.percentile(values, q)), *interval(_resampled(values, q, rng)))


def paired_ratio_ci(a: dict[str, float], b: dict[str, float], q: float = 50, seed: int = 0
                    ) -> tuple[float, float, float]:
    """percentile(a) / percentile(b) over the request keys both have, with the bootstrap
    interval of that ratio (keys resampled, each draw taking both configs' values)."""
    keys = sorted(a.keys() & b.keys())
    va = np.asarray([a[k] for k in keys], dtype=np.float64)
    vb = np.asarray([b[k] for k in keys], dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(keys), size=(BOOT, len(keys)))
    ratios = np.percentile(va[idx], q, axis=1) / np.percentile(vb[idx], q, axis=1)
    return (float(np.percentile(va, q) / np.percentile(vb, q)), *interval(ratios))


def aggregate(runs: list[dict]) -> dict:
    """One (workload, config)'s rounds -> pooled figures (``failed``: the rounds that failed)."""
    ok = [r for r in runs if "failed" not in r]
    out: dict = {"rounds": len(ok), "failed": [r["failed"] for r in runs if "failed" in r]}
    if not ok:
        return out
    ttft = [t for r in ok for t in r["ttft_s"]]
    prompt, cached = sum(r["prompt_tokens"] for r in ok), sum(r["cached_tokens"] for r in ok)
    tiers: dict[str, int] = {}
    for r in ok:
        for t, n in r["cached_tokens_by_tier"].items():
            tiers[t] = tiers.get(t, 0) + n
    out.update(hit_rate=cached / prompt if prompt else 0.0, prompt_tokens=prompt,
               cached_tokens=cached, cached_tokens_by_tier=tiers,
               ttft_by_request={f"{i}/{rid}": t for i, r in enumerate(runs) if "failed" not in r
                                for rid, t in r["ttft_by_request"].items()},
               round_hit_rates=[r["hit_rate"] for r in ok],
               round_ttft_p50_s=[float(np.percentile(r["ttft_s"], 50)) for r in ok if r["ttft_s"]],
               totals_s=[r["total_s"] for r in ok], requests=len(ttft),
               errors=sum(r["errors"] for r in ok), ttft_s=ttft)
    if ttft:
        out["ttft_p50"] = percentile_ci(ttft, 50)
        out["ttft_p90"] = percentile_ci(ttft, 90)
    return out


def verdict(ratio: tuple[float, float, float]) -> str:
    _, lo, hi = ratio
    return "wins" if hi < 1 else "loses" if lo > 1 else "not decided"


def _ms(ci: tuple[float, float, float]) -> str:
    return f"{ci[0] * 1e3:.0f} ms [{ci[1] * 1e3:.0f}, {ci[2] * 1e3:.0f}]"


def markdown(res: dict, aggs: dict[str, dict[str, dict]]) -> str:
    lines = [f"CPU: {res['cpu']}; {res['note']}", "",
             f"TTFT: all rounds' requests pooled, [{LEVEL:.0%} bootstrap interval]; per-round "
             "values in summary.json.", ""]
    for name, rows in aggs.items():
        lines += [f"### {name} ({res['workloads'][name]['shape']}, "
                  f"{res['workloads'][name]['pages']} pages per worker)", "",
                  "| config | hit rate (per round) | hits by tier | TTFT p50 | TTFT p90 | "
                  "total per round | requests | errors |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        for cfg, a in rows.items():
            if not a["rounds"]:
                lines.append(f"| {cfg} | failed: {a['failed'][0]} | | | | | | |")
                continue
            per = " / ".join(f"{h:.1%}" for h in a["round_hit_rates"])
            totals = " / ".join(f"{t:.1f}" for t in a["totals_s"])
            by_tier = ", ".join(f"{t} {n / a['prompt_tokens']:.1%}"
                                for t, n in a["cached_tokens_by_tier"].items() if n)
            lines.append(f"| {cfg} | {a['hit_rate']:.1%} ({per}) | {by_tier} | "
                         f"{_ms(a['ttft_p50'])} | "
                         f"{_ms(a['ttft_p90'])} | {totals} s | {a['requests']} | "
                         f"{a['errors']} |")
        rr = rows.get("round_robin", {})
        lines.append("")
        for cfg, a in rows.items():
            if cfg.startswith(("single_engine_2x", "round_robin")) or not a.get("rounds"):
                continue
            parts = []
            # against the single engine with the same pool, or without it where not run
            pooled = cfg.endswith("/pool") and "single_engine_2x/pool" in rows
            one = rows.get("single_engine_2x/pool" if pooled else "single_engine_2x", {})
            if one.get("hit_rate"):
                parts.append(f"hit rate {a['hit_rate'] / one['hit_rate']:.1%} of the single "
                             f"engine's{' (with the pool)' if pooled else ''}")
            if rr.get("ttft_by_request") and a.get("ttft_by_request"):
                r = paired_ratio_ci(a["ttft_by_request"], rr["ttft_by_request"])
                parts.append(f"TTFT p50 / round_robin's {r[0]:.2f}x [{r[1]:.2f}, {r[2]:.2f}]: "
                             f"{verdict(r)}")
            if parts:
                lines.append(f"- {cfg}: " + "; ".join(parts))
        lines.append("")
    return "\n".join(lines)
