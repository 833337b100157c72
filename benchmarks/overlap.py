"""Overlap scheduling A/B: end-to-end ``generate`` tokens/s of SmolLM2 with ``overlap_schedule``
off and on, two engines in this process run alternately (same prompts, same outputs asserted),
best round of each side.

    python benchmarks/overlap.py                          # batch 1/8/32, 1 compute thread
    python benchmarks/overlap.py --threads 2 --batches 1 8
    python benchmarks/overlap.py --device cuda            # where the forward is asynchronous

Besides tokens/s it reports the share of a plain run the engine thread spends outside the
forward pass and sampling (scheduling, batch tensors, stop checks, caching): the most overlap
can hide. On a CPU the worker's forward and the engine thread share the cores, so that share is
only hidden when a core is free (``--threads`` below the core count).
"""

from __future__ import annotations

import argparse
import json
import time

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import torch
from deepinfer.hardware import lscpu_model
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def engine_thread_share(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Share of a plain ``generate`` (overlap off) spent outside the model's forward and the
    sampling, the worker's part with overlap on: what overlap can hide at most."""
    runner = llm.engine.runner
    spent = [0.0]

    def timed(inner):
        def run(*args):
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    runner.logits, runner.sample = timed(runner.logits), timed(runner.sample)
    try:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        total = time.perf_counter() - t0
    finally:
        del runner.logits, runner.sample
    return 1 - spent[0] / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    kw = dict(enable_prefix_cache=False, host_cache_gb=0, enable_disk_cache=False, progress=False,
              device=args.device, threads=args.threads)
    engines = {"off": LLM(**kw), "on": LLM(overlap_schedule=True, **kw)}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for b in args.batches:
        gen = torch.Generator().manual_seed(b)
        prompts = torch.randint(100, 40000, (b, args.prompt_len), generator=gen).tolist()
        for llm in engines.values():
            llm.generate(prompts, params)  # warm-up
        best = {name: float("inf") for name in engines}
        outs = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
                best[name] = min(best[name], time.perf_counter() - t0)
        assert outs["off"] == outs["on"], "overlap scheduling changed the output"
        tokens = b * args.new_tokens
        row = {"batch": b, "off_tok_s": round(tokens / best["off"], 2),
               "on_tok_s": round(tokens / best["on"], 2),
               "on_over_off": round(best["off"] / best["on"], 3),
               "engine_thread_share": round(engine_thread_share(engines["off"], prompts, params), 3)}
        print(json.dumps(row), flush=True)
    for llm in engines.values():
        llm.engine.shutdown()
    print(f"CPU: {lscpu_model()}; device {args.device}, {args.threads} compute thread(s), "
          f"{torch.get_num_threads()} now; prompt {args.prompt_len}, {args.new_tokens} new tokens; "
          f"best of {args.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
