"""Capacity planner, report: ``plan.json``, ``plan.md`` and the hit-rate-vs-capacity plot of a
``PlanReport``."""

from __future__ import annotations

import math
from pathlib import Path

from deepinfer.bench.replay import ReplayResult
from deepinfer.bench.sweep import PlanReport, format_tokens


def write_plan_report(out_dir: str | Path, report: PlanReport, *, plots: bool = True) -> dict:
    """``plan.json``, ``plan.md`` and ``hit_rate_vs_capacity.png`` in ``out_dir``."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = report.as_dict()
    (out / "plan.json").write_text(json.dumps(doc, indent=2))
    (out / "plan.md").write_text(plan_markdown(report))
    if plots:
        plot_plan(report, out / "hit_rate_vs_capacity.png")
    return doc


def _pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def plan_markdown(report: PlanReport) -> str:
    lines = [f"# Cache capacity plan: {report.trace}", "",
             f"- requests: {report.requests:,}; input tokens: {report.input_tokens:,}",
             ("- ideal hit rate (infinite cache, block granularity): "
              f"{_pct(report.trace_ideal_hit_rate)}")]
    for ps, r in report.unbounded.items():
        lines.append(f"- unbounded L1 at page {ps} (what this engine reaches with infinite "
                     f"memory): {_pct(r.hit_rate)}")
    for k, v in report.meta.items():
        lines.append(f"- {k}: {v:.2f}" if isinstance(v, float) else f"- {k}: {v}")
    lines += ["", ("| page | L1 | L2 | L3 | hit rate | device | host | disk | / ideal | "
                   "evicted pages | failed | seconds (CPU) |"),
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sorted(report.points, key=lambda p: (p.page_size, p.l2_tokens, p.l3_tokens,
                                                  p.l1_tokens or 0)):
        t = p.hit_tokens_by_tier

        def frac(n: int, total: int = p.input_tokens) -> float:
            return n / total if total else 0.0

        lines.append(
            f"| {p.page_size} | {format_tokens(p.l1_tokens)} | {format_tokens(p.l2_tokens)} | "
            f"{format_tokens(p.l3_tokens)} | {_pct(p.hit_rate)} | "
            f"{_pct(frac(t.get('device', 0)))} | {_pct(frac(t.get('host', 0)))} | "
            f"{_pct(frac(t.get('disk', 0)))} | "
            f"{_pct(p.hit_rate / report.trace_ideal_hit_rate if report.trace_ideal_hit_rate else None)}"
            f" | {p.evicted_pages:,} | {p.failed_requests} | {p.seconds:.1f} "
            f"({p.cpu_seconds:.1f}) |")
    if report.target is not None:
        lines += ["", f"## Smallest sizes reaching {_pct(report.target)}", ""]
        for ps, s in report.smallest.items():
            one = s["l1_only"]
            lines.append(f"- page {ps}, L1 only: " + (
                "not reached on this grid" if one is None else
                f"{format_tokens(one['l1_tokens'])} tokens ({_pct(one['hit_rate'])})"))
            if s.get("l1_only_refined"):
                r = s["l1_only_refined"]
                lines.append(f"- page {ps}, L1 only, bisected: {r['l1_tokens']:,} tokens "
                             f"({_pct(r['hit_rate'])})")
            if any(d["l2_tokens"] or d["l3_tokens"] for d in s["pareto"]):
                lines.append(f"- page {ps}, minimal (L1, L2, L3): " + ", ".join(
                    f"({format_tokens(d['l1_tokens'])}, {format_tokens(d['l2_tokens'])}, "
                    f"{format_tokens(d['l3_tokens'])}) {_pct(d['hit_rate'])}"
                    for d in s["pareto"]))
    lines += ["", "![hit rate vs capacity](hit_rate_vs_capacity.png)", ""]
    return "\n".join(lines)


def plot_plan(report: PlanReport, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple[int, int, int], list[ReplayResult]] = {}
    for p in report.points:
        if p.l1_tokens is not None:
            groups.setdefault((p.page_size, p.l2_tokens, p.l3_tokens), []).append(p)
    multi_page = len({k[0] for k in groups}) > 1
    tiered = any(b or c for _, b, c in groups)
    for (ps, b, c), pts in sorted(groups.items()):
        pts.sort(key=lambda p: p.l1_tokens)  # type: ignore[arg-type,return-value]
        label = []
        if multi_page or not tiered:
            label.append(f"page {ps}")
        if b or c:
            label.append(f"L2 {format_tokens(b)}, L3 {format_tokens(c)}")
        elif tiered:
            label.append("L1 only")
        ax.plot([p.l1_tokens for p in pts], [p.hit_rate for p in pts], "o-", ms=3,
                label=", ".join(label) or "L1")
    ax.axhline(report.trace_ideal_hit_rate, color="k", ls="--", lw=1,
               label=f"ideal (infinite cache) {100 * report.trace_ideal_hit_rate:.1f}%")
    if report.target is not None:
        frac = report.meta.get("target_of_ideal")
        ax.axhline(report.target, color="tab:red", ls=":", lw=1,
                   label=f"target {100 * report.target:.1f}%"
                   + (f" ({100 * frac:g}% of ideal)" if frac else ""))
        for ps, s in report.smallest.items():
            best = s.get("l1_only_refined") or s.get("l1_only")
            if best is not None:
                x = best["l1_tokens"]
                ax.axvline(x, color="tab:red", ls=":", lw=1)
                ax.annotate(f"{format_tokens(x) if x % 10**5 == 0 else f'{x / 1e6:.1f}M'}"
                            + (f" (page {ps})" if multi_page else ""),
                            (x, report.target), textcoords="offset points", xytext=(4, -14),
                            fontsize=8, color="tab:red")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_tokens(int(v)) if v >= 1
                                               else ""))
    ax.set_xlabel("L1 (device) capacity, tokens")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, max(1e-3, min(1.0, 1.1 * max(
        [report.trace_ideal_hit_rate] + [p.hit_rate for p in report.points]))))
    ax.set_title(f"{Path(report.trace).stem}: hit rate vs cache capacity "
                 f"({report.requests:,} requests, {report.input_tokens / 1e6:.0f}M tokens)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
