"""What one step costs on the speculative path next to the plain decode path, in one engine,
the variants alternating step by step (so a busy machine slows them alike).

One engine with scheduled prompt lookup (k = 8) decodes a workload's prompt of
``benchmarks/spec.py``; its steps take turns: ``plain`` (the engine's plain decode path, no
speculation), ``v=0`` (the speculative path with the plan forced to verify nothing: drafting,
scheduling and the span forward with no span) and ``v=1,2,4,8`` (the plan forced to verify that
many draft tokens, where the draft has them). Reports each variant's median step time, its
ratio to ``plain``, and the ratio the engine's SPS profile prices that step at.

    python benchmarks/spec_steps.py [--workload code|agent|chat] [--dtype auto] [--quantization none]
                                    [--max-tokens 200] [--passes 2]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import deepinfer.spec.decoder as decoder
from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from spec import WARM_UP, WORKLOADS

FORCED = (0, 1, 2, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="code", choices=list(WORKLOADS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory_gb=0.5,
              host_cache_gb=0, enable_disk_cache=False, enable_prefix_cache=False, progress=False,
              speculative_config=SpeculativeConfig(method="ngram", num_tokens=8))
    engine, spec = llm.engine, llm.engine.spec
    assert spec is not None and spec.sps is not None
    llm.chat([{"role": "user", "content": WARM_UP}], SamplingParams(max_tokens=16, temperature=0.0))
    plan, force = decoder.plan_verify, [-1]
    decoder.plan_verify = lambda survival, sps, base=0: (
        plan(survival, sps, base) if force[0] < 0 else [min(force[0], len(s)) for s in survival])
    variants = itertools.cycle(["plain", *FORCED])
    times: dict[tuple[str, int], list[float]] = {}
    step = engine.step

    def alternating() -> list:
        variant = next(variants)
        before = sum(c.verified for c in spec.totals.values())
        engine.spec, force[0] = (None, -1) if variant == "plain" else (spec, variant)
        t0 = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - t0
        engine.spec, force[0] = spec, -1
        verified = sum(c.verified for c in spec.totals.values()) - before
        times.setdefault(("plain" if variant == "plain" else f"v={variant}", verified), []).append(seconds)
        return out

    engine.step = alternating
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for _ in range(args.passes):
        llm.chat([{"role": "user", "content": WORKLOADS[args.workload][0]}], params)
    plain = statistics.median(times[("plain", 0)])
    profile = next(iter(spec.sps.profiles.values()))
    print(f"CPU: {lscpu_model()}; workload {args.workload}, dtype {args.dtype}, quantization "
          f"{args.quantization}, {args.passes} x {args.max_tokens} tokens, steps alternating")
    print("| variant | verified | steps | median ms | vs plain | profile's price |\n|---|---:|---:|---:|---:|---:|")
    for (variant, verified), ts in sorted(times.items(), key=lambda kv: (kv[0][0] != "plain", kv[0][1])):
        if len(ts) >= 3 and (variant == "plain" or variant == f"v={verified}"):
            print(f"| {variant} | {verified} | {len(ts)} | {1e3 * statistics.median(ts):.2f} | "
                  f"{statistics.median(ts) / plain:.3f} | {profile(1) / profile(1 + verified):.3f} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
