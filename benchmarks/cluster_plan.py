"""Scale on paper: N replicas with local caches vs the same replicas sharing one KV pool
(``--kv-store``), per routing policy, on the public traces (``deepinfer/bench/cluster.py``: the
engine's own cache code, no model).

Per trace, each replica's local cache (L1) holds ``--local-share`` of the trace's distinct
prompt tokens (the ideal cache's footprint) and the pool holds all of them. Printed as a
Markdown table (hit rate local-only, with the pool, the gain, next to one engine with all N
replicas' memory and the ideal), written to results/cluster/cluster.json and
docs/img/cluster_hit_rates.png.

    python benchmarks/cluster_plan.py [--traces DIR] [--replicas 4] [--local-share 0.125]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from deepinfer.bench.cluster import POLICIES, compare
from deepinfer.bench.ideal import ideal_hits
from deepinfer.bench.traces import default_traces_dir, load_trace

REPO = Path(__file__).resolve().parents[1]
# name -> (path in the traces folder, token_scale: lengths and blocks shrunk, reuse kept)
TRACES = {"mooncake_conversation": ("mooncake_conversation_trace.jsonl", 0.125),
          "mooncake_synthetic": ("mooncake_synthetic_trace.jsonl", 0.125),
          "taubench_airline": ("derived_taubench_airline_blk64.jsonl", 1.0),
          "kv-cache-tester": ("kv-cache-tester", 1.0)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), sharey=True)
    for ax, name in zip(axes if len(names) > 1 else [axes], names):
        r = results[name]
        labels = [row["policy"] for row in r["rows"]]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [row["local"] for row in r["rows"]], 0.4, label="local only")
        ax.bar([i + 0.2 for i in x], [row["shared"] for row in r["rows"]], 0.4, label="shared pool")
        ax.axhline(r["ideal"], color="k", ls="--", lw=1, label="ideal")
        ax.axhline(r["single_all_memory"], color="gray", ls=":", lw=1, label="one engine, all memory")
        ax.set_xticks(list(x), labels)
        ax.set_title(f"{name} ({r['replicas']} replicas)", fontsize=9)
        ax.set_ylabel("prompt tokens from cache")
    axes[0].legend(fontsize=7) if len(names) > 1 else axes.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=None, help="traces folder (default: ../shared/traces)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per replica")
    ap.add_argument("--local-share", type=float, default=0.125,
                    help="each replica's L1, as a share of the trace's distinct prompt tokens")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--out", default=str(REPO / "results" / "cluster"))
    ap.add_argument("--img", default=str(REPO / "docs" / "img"))
    args = ap.parse_args()
    base = Path(args.traces) if args.traces else default_traces_dir()
    if base is None:
        print("traces folder not found (set DEEPINFER_TRACES)", file=sys.stderr)
        return 2
    results = {}
    for name, (file, scale) in TRACES.items():
        trace = load_trace(base / file, max_requests=args.max_requests, token_scale=scale)
        ideal = ideal_hits(trace)
        footprint = ideal.total_input_tokens - ideal.total_hit_tokens  # tokens computed once
        l1 = max(args.page_size, int(footprint * args.local_share))
        results[name] = {"token_scale": scale, **compare(
            trace, replicas=args.replicas, page_size=args.page_size, l1_tokens=l1,
            pool_tokens=footprint + len(trace) * args.page_size, concurrency=args.concurrency,
            policies=POLICIES)}
    print(f"CPU: {cpu_model()}")
    print(f"{args.replicas} replicas, {args.concurrency} requests in flight each, page "
          f"{args.page_size}; local L1 per replica = {args.local_share:g} x distinct prompt tokens\n")
    print("| trace | requests | policy | local only | shared pool | gain | one engine, all memory | ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        for row in r["rows"]:
            gain = f"{row['gain']:.2f}x" if row["gain"] else "-"
            print(f"| {name} | {r['requests']} | {row['policy']} | {row['local']:.1%} | "
                  f"{row['shared']:.1%} | {gain} | {r['single_all_memory']:.1%} | {r['ideal']:.1%} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps({"cpu": cpu_model(), "args": vars(args),
                                                  "results": results}, indent=1))
    Path(args.img).mkdir(parents=True, exist_ok=True)
    plot(results, Path(args.img) / "cluster_hit_rates.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
