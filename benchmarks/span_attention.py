"""A verify span's attention alone, one layer of SmolLM2-135M's shape (9 q heads, 3 kv heads, dim
64, 16-token pages, pages in random order): B consecutive rows of one sequence through the span
kernel (``paged_span``, each K/V block read once for all rows) vs the same rows as B decode rows
(``paged_decode``, the path before it: every row reads the whole context), plus a 1-row decode;
interleaved call by call in one process, median of ``--reps`` per side. Both give the same bits.

    python benchmarks/span_attention.py [--spans 2 3 5 9] [--contexts 2048] [--threads 2]

Prints the CPU model and the load average with the results.
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import json
import os
import statistics
import time

import torch

from deepinfer.hardware import lscpu_model
from deepinfer.layers.native_decode import native_decode_kernel

HQ, HKV, DIM, PAGE = 9, 3, 64, 16


def measure(rows: int, context: int, reps: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(rows)
    num_pages = -(-context // PAGE)
    k = torch.randn(num_pages, PAGE, HKV, DIM, generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, HKV, DIM, generator=g).to(dtype)
    q = torch.randn(rows, HQ, DIM, generator=g).to(dtype)
    pages = torch.randperm(num_pages, generator=g)
    lens = torch.arange(context - rows + 1, context + 1)
    table = pages[None].expand(rows, -1).contiguous()
    ops, scale = torch.ops.deepinfer_attention, DIM ** -0.5
    sides = {"span": lambda: ops.paged_span(q, k, v, pages, context, 0, 0, None, scale),
             "rows": lambda: ops.paged_decode(q, k, v, table, lens, None, None, None, scale),
             "decode1": lambda: ops.paged_decode(q[-1:], k, v, table[-1:], lens[-1:], None, None, None, scale)}
    assert torch.equal(sides["span"](), sides["rows"]())
    times: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(reps):
        for side, call in sides.items():
            t0 = time.perf_counter()
            call()
            times[side].append(time.perf_counter() - t0)
    med = {s: statistics.median(t) for s, t in times.items()}
    return {"rows": rows, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "span_ms": med["span"] * 1e3, "rows_ms": med["rows"] * 1e3, "decode1_ms": med["decode1"] * 1e3,
            "rows_over_span": med["rows"] / med["span"], "span_over_decode1": med["span"] / med["decode1"],
            "rows_over_decode1": med["rows"] / med["decode1"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spans", type=int, nargs="+", default=list(range(2, 10)))
    p.add_argument("--contexts", type=int, nargs="+", default=[2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    args = p.parse_args()
    kernel = native_decode_kernel()
    if not kernel.loaded:
        raise SystemExit(f"native decode attention unavailable: {kernel.error}")
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes:
        for c in args.contexts:
            for b in args.spans:
                print(json.dumps(measure(b, c, args.reps, getattr(torch, dtype))), flush=True)
    print(f"CPU: {lscpu_model()}, {args.threads} thread(s), kernel {kernel.isa}; one layer, median of "
          f"{args.reps} interleaved calls per side; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
