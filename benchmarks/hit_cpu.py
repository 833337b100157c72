"""Cold prefill against an L1 prefix hit, in CPU seconds per thread (issue 17's ratio on a busy machine).

One process: a cold prefill of ``--prompt`` tokens, then ``--tails`` prompts sharing its first
``--cached`` tokens (each a fresh tail: an L1 hit). Per request, the CPU time of every thread
of the process (``/proc/self/task/*/schedstat``, nanoseconds) next to the wall time. Other
processes stretch the wall time but barely the CPU time, so the CPU ratios hold up under load.
The engine's main thread also runs one of the two compute threads: where the cores are free its
CPU time tracks the wall time, and its excess over the busiest other thread is the work only it
does (Python, the engine, serial parts of ops). Compare two trees by running this script under
each one's ``PYTHONPATH`` in turn, interleaved.
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import json
import os
import threading
import time

from core import random_prompts
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each live thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            pass
    return out


def measured(llm: LLM, prompt: list[int]) -> dict:
    """Wall, main-thread and all-thread CPU seconds of one single-token request."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    main = threading.get_native_id()
    before, t0 = thread_cpu(), time.perf_counter()
    out = llm.generate(prompt, one)[0]
    wall, after = time.perf_counter() - t0, thread_cpu()
    used = {t: after[t] - before.get(t, 0.0) for t in after}
    mine = used.pop(main, 0.0)
    return {"wall": wall, "main_cpu": mine, "cpu": mine + sum(used.values()),
            "main_only": mine - max(used.values(), default=0.0),
            "cached": sum(out.cached_tokens_by_tier.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M)")
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--cached", type=int, default=7680, help="a multiple of the page size")
    ap.add_argument("--tails", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    args = ap.parse_args()
    llm = LLM(args.model, progress=False, host_cache_gb=0, enable_disk_cache=False,
              max_num_batched_tokens=args.chunk)
    vocab = llm.engine.hf_config.vocab_size
    tail = args.prompt - args.cached
    tails = random_prompts(args.tails + 2, tail, vocab, seed=1)
    measured(llm, tails[0])  # first-call costs at the tail's shape
    cached = random_prompts(1, args.cached, vocab, seed=0)[0]
    cold = measured(llm, cached + tails[1])
    hits = [measured(llm, cached + t) for t in tails[2:]]
    assert all(h["cached"] == args.cached for h in hits), hits
    hit = {k: sum(h[k] for h in hits) / len(hits) for k in ("wall", "main_cpu", "cpu", "main_only")}
    print(json.dumps({"cold": cold, "hit": hit, "load_average": os.getloadavg()}))
    print("| | wall s | CPU s (all threads) | CPU s (main thread) | main thread only |\n|---|---|---|---|---|")
    for name, r in (("cold", cold), ("hit", hit)):
        print(f"| {name} | {r['wall']:.3f} | {r['cpu']:.3f} | {r['main_cpu']:.3f} | {r['main_only']:.3f} |")
    print(f"| cold / hit | {cold['wall'] / hit['wall']:.2f}x | {cold['cpu'] / hit['cpu']:.2f}x | "
          f"{cold['main_cpu'] / hit['main_cpu']:.2f}x | |")


if __name__ == "__main__":
    main()
