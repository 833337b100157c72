"""Results folder of one benchmark run: JSON, Markdown and PNG plots.

``write_report(run_dir, {config: records})`` writes

* ``summary.json``: ``{"run", "meta", "configs": {name: metrics.summarize(...)}, "baseline",
  "speedup_vs_baseline"}``
* ``records.jsonl``: every request record, with its ``config``
* ``summary.md``: one Markdown table, one column per config (cache on / off, other engines)
* ``ttft_cdf.png``, ``hit_rate.png``, ``hit_rate_over_requests.png``
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.bench.metrics import RequestRecord, cumulative_hit_rate, summarize, tier_key


def write_report(
    run_dir: str | Path,
    configs: Mapping[str, Sequence[RequestRecord]],
    *,
    meta: Mapping[str, Any] | None = None,
    ideal_hit_rate: float | None = None,
    bytes_by_tier: Mapping[str, Mapping[str, int]] | None = None,
    duration_s: Mapping[str, float] | None = None,
    baseline: str | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Summarize every config's records and write the results folder; returns summary.json.

    ``bytes_by_tier`` and ``duration_s`` are per config; ``baseline`` (a config name, e.g.
    the cache-off run) adds speedup ratios of the other configs against it.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summaries = {
        name: summarize(
            recs,
            ideal_hit_rate=ideal_hit_rate,
            bytes_by_tier=(bytes_by_tier or {}).get(name),
            duration_s=(duration_s or {}).get(name),
        )
        for name, recs in configs.items()
    }
    speedups = _speedups(summaries, baseline) if baseline in summaries else None
    doc = {
        "run": run_dir.name,
        "meta": dict(meta or {}),
        "configs": summaries,
        "baseline": baseline if speedups is not None else None,
        "speedup_vs_baseline": speedups,
    }
    (run_dir / "summary.json").write_text(json.dumps(doc, indent=2, default=_json_default))
    with open(run_dir / "records.jsonl", "w") as f:
        for name, recs in configs.items():
            for r in recs:
                f.write(json.dumps({"config": name, **r.to_dict()}, default=_json_default) + "\n")
    (run_dir / "summary.md").write_text(markdown_summary(doc))
    if plots:
        plot_all(run_dir, configs, summaries)
    return doc


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(f"not JSON serializable: {type(o)}")


def _speedups(summaries: Mapping[str, dict], baseline: str) -> dict[str, dict[str, float | None]]:
    base = summaries[baseline]

    def ratio(b: float | None, x: float | None) -> float | None:
        return b / x if b and x else None

    out = {}
    for name, s in summaries.items():
        if name == baseline:
            continue
        out[name] = {
            "ttft_p50": ratio(base["ttft_s"]["p50"], s["ttft_s"]["p50"]),
            "ttft_p90": ratio(base["ttft_s"]["p90"], s["ttft_s"]["p90"]),
            "e2e_p50": ratio(base["e2e_s"]["p50"], s["e2e_s"]["p50"]),
            "duration": ratio(base["duration_s"], s["duration_s"]),
            "prefill_tokens_saved": (
                base["prefill_tokens_computed"] - s["prefill_tokens_computed"]
                if base["prefill_tokens_computed"] is not None
                and s["prefill_tokens_computed"] is not None
                else None
            ),
        }
    return out


# ---------------------------------------------------------------------------------- markdown
def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.1f}"


def _num(x: float | int | None, fmt: str = "{:,.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return fmt.format(x)


def _bytes(x: int | None) -> str:
    if x is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(x)


def markdown_summary(doc: Mapping[str, Any]) -> str:
    configs: Mapping[str, dict] = doc["configs"]
    names = list(configs)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn) -> None:
        rows.append((label, [fn(configs[n]) for n in names]))

    row("requests", lambda s: _num(s["num_requests"]))
    row("errors", lambda s: _num(s["num_errors"]))
    row("prompt tokens", lambda s: _num(s["prompt_tokens"]))
    row("cached tokens", lambda s: _num(s["cached_tokens"]))
    row("**token hit rate**", lambda s: _pct(s["hit_rate"]))
    if any((s.get("cache_reported_fraction") or 0) < 1 for s in configs.values()):
        row("cached tokens reported by", lambda s: _pct(s.get("cache_reported_fraction")))
    tiers = sorted({t for s in configs.values() for t in s["hit_rate_by_tier"]}, key=tier_key)
    for t in tiers:
        row(f"hit rate: {t}", lambda s, t=t: _pct(s["hit_rate_by_tier"].get(t)))
    row("ideal hit rate (infinite cache)", lambda s: _pct(s["ideal_hit_rate"]))
    row("achieved / ideal", lambda s: _pct(s["achieved_over_ideal"]))
    row("prefill tokens computed", lambda s: _num(s["prefill_tokens_computed"]))
    row("completion tokens", lambda s: _num(s["completion_tokens"]))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        for p in ("p50", "p90", "p99"):
            row(f"{label} {p} (ms)", lambda s, key=key, p=p: _ms(s[key][p]))
    row("duration (s)", lambda s: _num(s["duration_s"], "{:,.2f}"))
    row("requests/s", lambda s: _num(s["throughput"]["requests_per_s"], "{:,.2f}"))
    row("output tokens/s", lambda s: _num(s["throughput"]["output_tokens_per_s"], "{:,.1f}"))
    row("total tokens/s", lambda s: _num(s["throughput"]["total_tokens_per_s"], "{:,.1f}"))
    btiers = sorted({t for s in configs.values() for t in (s.get("bytes_by_tier") or {})},
                    key=tier_key)
    for t in btiers:
        row(f"bytes moved: {t}", lambda s, t=t: _bytes((s.get("bytes_by_tier") or {}).get(t)))
    sp = doc.get("speedup_vs_baseline")
    if sp:
        base = doc["baseline"]
        for key, label in (("ttft_p50", "TTFT p50"), ("e2e_p50", "E2E p50"),
                           ("duration", "duration")):
            rows.append((f"{label} speedup vs {base}",
                         [_num(sp[n][key], "{:.2f}x") if n in sp else "1.00x" for n in names]))
    lines = [f"# Benchmark {doc.get('run', '')}", ""]
    for k, v in (doc.get("meta") or {}).items():
        lines.append(f"- **{k}**: {v}")
    if doc.get("meta"):
        lines.append("")
    lines.append("| metric | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for label, vals in rows:
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    lines.append("")
    lines.append("![TTFT CDF](ttft_cdf.png) ![hit rate](hit_rate.png) "
                 "![hit rate over requests](hit_rate_over_requests.png)")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- plots
def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_all(
    run_dir: Path, configs: Mapping[str, Sequence[RequestRecord]], summaries: Mapping[str, dict]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # TTFT CDF per config
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in configs.items():
        v = np.sort([r.ttft_s for r in recs if r.ok and r.ttft_s is not None])
        if v.size:
            ax.step(v * 1000, np.arange(1, v.size + 1) / v.size, where="post", label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(run_dir / "ttft_cdf.png", dpi=100)
    plt.close(fig)

    # hit rate per config (stacked by tier when tiers are reported), ideal as a line
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(summaries) + 2), 4))
    names = list(summaries)
    x = np.arange(len(names))
    tiers = sorted({t for s in summaries.values() for t in s["hit_rate_by_tier"]}, key=tier_key)
    if tiers:
        bottom = np.zeros(len(names))
        for t in tiers:
            h = np.array([summaries[n]["hit_rate_by_tier"].get(t, 0.0) for n in names])
            ax.bar(x, h, bottom=bottom, label=t)
            bottom += h
        rest = np.array([summaries[n]["hit_rate"] or 0.0 for n in names]) - bottom
        if (rest > 1e-9).any():
            ax.bar(x, np.clip(rest, 0, None), bottom=bottom, label="unattributed")
    else:
        ax.bar(x, [summaries[n]["hit_rate"] or 0.0 for n in names], label="hit rate")
    ideal = next((s["ideal_hit_rate"] for s in summaries.values()
                  if s["ideal_hit_rate"] is not None), None)
    if ideal is not None:
        ax.axhline(ideal, color="k", ls="--", lw=1, label=f"ideal {100 * ideal:.1f}%")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylim(0, 1)
    ax.set_ylabel("token hit rate")
    ax.set_title("Prefix-cache hit rate")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(run_dir / "hit_rate.png", dpi=100)
    plt.close(fig)

    # cumulative hit rate over request index
    fig, ax = plt.subplots(figsize=(6, 4))
    ideal_done = False
    for name, recs in configs.items():
        c = cumulative_hit_rate(recs)
        if c.size:
            ax.plot(np.arange(1, c.size + 1), c, label=name)
        ok = sorted((r for r in recs if r.ok), key=lambda r: r.arrival_s)
        if not ideal_done and ok and all(r.ideal_cached_tokens is not None for r in ok):
            p = np.cumsum([r.prompt_tokens for r in ok], dtype=np.float64)
            i = np.cumsum([r.ideal_cached_tokens for r in ok], dtype=np.float64)
            ax.plot(np.arange(1, p.size + 1), np.divide(i, p, out=np.zeros_like(i), where=p > 0),
                    "k--", lw=1, label="ideal")
            ideal_done = True
    ax.set_xlabel("request index (arrival order)")
    ax.set_ylabel("cumulative token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(run_dir / "hit_rate_over_requests.png", dpi=100)
    plt.close(fig)
