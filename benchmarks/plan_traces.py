"""Capacity plans of the public Mooncake traces, as published in the README.

For each trace: the planner over 12 log-spaced L1 sizes from 1M to 200M tokens at page 512
(the engine's cache code, no model), the smallest L1 reaching 90% of the ideal hit rate
(bisected between grid points), written to results/planner/<trace>/ (plan.json, plan.md,
hit_rate_vs_capacity.png); the plots are copied to docs/img/planner_<trace>.png.

    python benchmarks/plan_traces.py [--traces DIR] [--l1 1M:200M:12] [--page-sizes 512]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from deepinfer.bench.cli import main as bench_main
from deepinfer.bench.traces import default_traces_dir

REPO = Path(__file__).resolve().parents[1]
TRACES = {"mooncake_conversation": "mooncake_conversation_trace.jsonl",
          "mooncake_synthetic": "mooncake_synthetic_trace.jsonl"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=None, help="traces folder (default: ../shared/traces)")
    ap.add_argument("--l1", default="1M:200M:12")
    ap.add_argument("--page-sizes", default="512")
    ap.add_argument("--out", default=str(REPO / "results" / "planner"))
    ap.add_argument("--img", default=str(REPO / "docs" / "img"))
    args = ap.parse_args()
    base = Path(args.traces) if args.traces else default_traces_dir()
    if base is None:
        print("traces folder not found (set DEEPINFER_TRACES)", file=sys.stderr)
        return 2
    Path(args.img).mkdir(parents=True, exist_ok=True)
    for run, name in TRACES.items():
        rc = bench_main(["plan-cache", "--trace", str(base / name), "--l1", args.l1,
                         "--page-sizes", args.page_sizes, "--target-of-ideal", "0.9",
                         "--refine", "--out", args.out, "--run", run])
        if rc:
            return rc
        shutil.copy(Path(args.out) / run / "hit_rate_vs_capacity.png",
                    Path(args.img) / f"planner_{run}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
