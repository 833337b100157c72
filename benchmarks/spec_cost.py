"""What a verify step costs next to a plain decode step, by context length, batch size and
extra (draft) tokens: the numbers the scheduler's SPS profile has to get right.

One engine, its runner called directly: B sequences whose KV holds ``context`` tokens step
once with 1 new token each (a decode step) or with 1 + e (a verify step of e draft tokens),
the variants interleaved round after round, so a busy machine slows them alike; the KV is
rewritten in place, nothing advances. Reports the median step time and its ratio to the
decode step of the same context and batch, plus the split of one verify step's time by
operator (torch.profiler) with ``--profile``. ``--compare-f-linear`` also times every variant
with the float linears on ``F.linear`` (the path before ``layers/small_row_linear.py``),
interleaved with the native small-row kernel, and prints both tables.

    python benchmarks/spec_cost.py [--contexts 100,1000,3000] [--batches 1,4] [--extra 1,2,4,8]
                                   [--rounds 7] [--quantization none|int4] [--profile]
                                   [--compare-f-linear]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import torch
import torch.nn.functional as F

from deepinfer.hardware import lscpu_model
from deepinfer.layers.small_row_linear import SmallRowLinear
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams


@contextmanager
def linears_on(path: str):
    """``path`` "f_linear": every swapped float linear runs ``F.linear`` for the block."""
    native = SmallRowLinear.forward
    if path == "f_linear":
        SmallRowLinear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
    try:
        yield
    finally:
        SmallRowLinear.forward = native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="100,1000,3000")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--extra", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--profile", action="store_true", help="operator split of one verify step")
    ap.add_argument("--compare-f-linear", action="store_true",
                    help="also time every variant with the float linears on F.linear, interleaved")
    args = ap.parse_args()
    llm = LLM(args.model, quantization=args.quantization, kv_cache_memory_gb=1.5, host_cache_gb=0,
              enable_disk_cache=False, enable_prefix_cache=False, progress=False)
    runner, kv = llm.engine.runner, llm.engine.kv
    extras = [int(e) for e in args.extra.split(",")]
    paths = ["small_rows", "f_linear"] if args.compare_f_linear else ["small_rows"]
    swapped = sum(isinstance(m, SmallRowLinear) for m in runner.model.modules())
    print(f"CPU: {lscpu_model()}; quantization {args.quantization}; {swapped} small-row float linears; "
          f"{args.rounds} rounds, variants interleaved; median step ms (ratio to decode)")
    header = ("| context | batch | linears | decode ms | " + " | ".join(f"+{e}" for e in extras) + " |\n"
              + "|---:|---:|---|---:|" + "---:|" * len(extras))
    print(header)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        for bs in (int(b) for b in args.batches.split(",")):
            reqs = []
            for i in range(bs):
                r = Request(f"cost-{i}", [(7 * i + 13 * t) % 30000 + 10 for t in range(ctx + max(extras) + 1)],
                            params)
                assert kv.allocate(r, r.num_tokens), "KV pool too small"
                runner.forward([(r, ctx)])  # fill the context's KV
                r.num_computed_tokens = ctx
                reqs.append(r)
            variants = [(p, e) for p in paths for e in [0] + extras]
            times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds + 1):  # the first round warms up
                for p, e in variants:
                    with linears_on(p):
                        t0 = time.perf_counter()
                        runner.forward_spans([(r, 1 + e) for r in reqs], {r: 1 + e for r in reqs} if e else {})
                        times[p, e].append(time.perf_counter() - t0)
            med = {v: statistics.median(ts[1:]) for v, ts in times.items()}
            for p in paths:
                d = med[p, 0]
                print(f"| {ctx} | {bs} | {p} | {1000 * d:.1f} | "
                      + " | ".join(f"{1000 * med[p, e]:.1f} ({med[p, e] / d:.2f})" for e in extras) + " |")
            if args.profile:
                for e in (0, extras[-1]):
                    with torch.profiler.profile() as prof:
                        runner.forward_spans([(r, 1 + e) for r in reqs], {r: 1 + e for r in reqs} if e else {})
                    print(f"context {ctx}, batch {bs}, +{e}:")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            for r in reqs:
                kv.release(r)
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
