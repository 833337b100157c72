"""Decode attention alone, one layer of SmolLM2-135M's shape (9 q heads, 3 kv heads, dim 64,
16-token pages): the torch path (gather every page into the workspace, then SDPA) vs our native
kernel reading the pages in place, interleaved call by call in one process (best of ``--reps``
per side), per batch size and context.

``--spans 2 5 9``: instead, B consecutive rows of one sequence (a verify span) through the span
kernel (``paged_span``: each K/V block read once for all rows) vs the same rows as B decode rows
(``paged_decode``, the path before it: every row reads the whole context) and a 1-row decode,
interleaved, median of ``--reps`` per side; both give the same bits (asserted).

    python benchmarks/decode_attention.py [--batches 1 8 32] [--contexts 128 2700] [--threads 2]
    python benchmarks/decode_attention.py --spans 2 3 5 9 --contexts 2048 --dtypes bfloat16
    python benchmarks/decode_attention.py --batches 32 --contexts 97 --dtypes bfloat16 --threads 1 --cold-mb 96

``--cold-mb N`` reads an N MB buffer before every call, as a step's weights go through the caches
between one layer's attention and the next, so K/V come from memory; ``kv_mb`` is what a call
reads of them, ``native_gb_s`` that over the native call's time.

Prints the CPU model with the results; one layer's time x 30 is what a SmolLM2 step spends on it.
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import json
import os
import statistics
import time

import torch

from deepinfer.forward_batch import ForwardBatch, Workspace
from deepinfer.hardware import lscpu_model
from deepinfer.layers.attention import decode_attention
from deepinfer.layers.native_decode import native_decode_kernel

HQ, HKV, DIM, PAGE = 9, 3, 64, 16


def make_batch(batch: int, context: int, backend: str, workspace: Workspace) -> ForwardBatch:
    pages_per_seq = -(-context // PAGE)
    perm = torch.randperm(batch * pages_per_seq, generator=torch.Generator().manual_seed(0)) + 1
    return ForwardBatch(input_ids=torch.zeros(batch, dtype=torch.long), positions=torch.full((batch,), context - 1),
                        slot_mapping=torch.zeros(batch, dtype=torch.long), page_size=PAGE, num_decodes=batch,
                        decode_pages=perm.view(batch, pages_per_seq), decode_kv_lens=torch.full((batch,), context),
                        prefills=[], logits_indices=torch.arange(batch), workspace=workspace,
                        attention_backend=backend)


def measure(batch: int, context: int, reps: int, dtype: torch.dtype, sweep: torch.Tensor | None = None) -> dict:
    g = torch.Generator().manual_seed(1)
    num_pages = batch * -(-context // PAGE) + 1
    k = torch.randn(num_pages, PAGE, HKV, DIM, generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, HKV, DIM, generator=g).to(dtype)
    q = torch.randn(batch, HQ, DIM, generator=g).to(dtype)
    ws = Workspace()
    best = {"torch": float("inf"), "native": float("inf")}
    for _ in range(reps):
        for side, backend in (("torch", "torch"), ("native", "auto")):
            b = make_batch(batch, context, backend, ws)  # a new batch per step, as the runner builds
            if sweep is not None:
                sweep.max()
            t0 = time.perf_counter()
            decode_attention(q, k, v, b, DIM ** -0.5)
            best[side] = min(best[side], time.perf_counter() - t0)
    kv_mb = 2 * batch * context * HKV * DIM * k.element_size() / 1e6
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "torch_ms": best["torch"] * 1e3, "native_ms": best["native"] * 1e3,
            "speedup": best["torch"] / best["native"], "kv_mb": kv_mb, "native_gb_s": kv_mb / best["native"] / 1e3}


def measure_span(rows: int, context: int, reps: int, dtype: torch.dtype) -> dict:
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
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 2700])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--spans", type=int, nargs="+", default=[], help="span rows to time (instead of batches)")
    p.add_argument("--cold-mb", type=int, default=0, help="read this many MB before each decode call")
    args = p.parse_args()
    kernel = native_decode_kernel()
    if not kernel.loaded:
        raise SystemExit(f"native decode attention unavailable: {kernel.error}")
    torch.set_num_threads(args.threads)
    sweep = torch.ones(args.cold_mb << 20, dtype=torch.uint8) if args.cold_mb else None
    for dtype in args.dtypes:
        for c in args.contexts:
            for b in args.spans or args.batches:
                if args.spans:
                    row = measure_span(b, c, args.reps, getattr(torch, dtype))
                else:
                    row = measure(b, c, args.reps, getattr(torch, dtype), sweep)
                print(json.dumps(row), flush=True)
    print(f"CPU: {lscpu_model()}, {args.threads} thread(s), kernel {kernel.isa}; one layer, "
          f"{'median' if args.spans else 'best'} of {args.reps} interleaved calls per side"
          f"{f', {args.cold_mb} MB read before each' if sweep is not None else ''}; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
