"""What bounds a whole-prompt fp32 prefill (issue 11's 1.2x-transformers target), measured.

Two measurements, each interleaved round by round and best of ``--rounds``:

1. The model's own linear weights (every layer's qkv, o, gate_up and down projection) at
   M = prompt tokens, through each fp32 GEMM the CPU build of torch offers: ``F.linear`` (what
   the engine runs: MKL sgemm), MKL packed weights (``mkl._mkl_linear``, what inductor's CPU
   freezing uses), oneDNN (``mkldnn._linear_pointwise``) on the plain and on a prepacked
   weight. Printed: GFLOP/s, the ratio to ``F.linear`` and the largest output difference.
2. The engine's whole prefill (``LLM.generate``, one token) with the time spent inside its
   ``nn.Linear`` layers (forward hooks), next to transformers' forward on the same prompt.
   From these: the share of the prefill in GEMMs, and the ceiling on ours / transformers if
   everything but the GEMMs cost nothing, or if the GEMMs ran at the fastest backend's rate.

With one thread the clock is CPU time (robust to other processes on a shared machine), with
more it is wall time.

    python benchmarks/prefill_bound.py [--threads N] [--tokens 512 2048] [--rounds 3]

Writes results/prefill_bound/summary.json and summary.md; prints the CPU model with them.
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from core import random_prompts, write_summary
from torch import nn
from transformers import AutoModelForCausalLM

from deepinfer.hardware import cpu_isa, lscpu_model
from deepinfer.layers.prepacked_linear import PrepackedLinear
from deepinfer.layers.small_row_linear import SmallRowLinear
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.threads import available_cores

Backend = Callable[[torch.Tensor], torch.Tensor]


def backends(w: torch.Tensor, m: int) -> dict[str, Backend]:
    """The fp32 GEMMs ``x @ w.T`` for x [m, in], each with its weight prepared once."""
    mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    dnn_w = torch.ops.mkldnn._reorder_linear_weight(w, m)
    return {
        "F.linear (MKL sgemm)": lambda x: F.linear(x, w),
        "MKL packed": lambda x: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, m),
        "oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, dnn_w, None, "none", [], ""),
    }


def gemm_row(weights: list[torch.Tensor], m: int, clock, rounds: int) -> dict:
    """Every weight once per call, as one prefill runs them; best of ``rounds`` per backend."""
    inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
    per_weight = [backends(w, m) for w in weights]
    names = list(per_weight[0])
    flops = sum(2 * m * w.shape[0] * w.shape[1] for w in weights)
    best = dict.fromkeys(names, float("inf"))
    for r in range(rounds + 1):  # the first round warms every backend up and is not counted
        for name in names[r % len(names):] + names[: r % len(names)]:  # each round starts elsewhere
            t0 = clock()
            for w, fns in zip(weights, per_weight):
                fns[name](inputs[w.shape[1]])
            if r > 0:
                best[name] = min(best[name], clock() - t0)
    w, x = weights[0], inputs[weights[0].shape[1]]
    ref = F.linear(x, w)
    diff = {name: (fn(x) - ref).abs().max().item() for name, fn in per_weight[0].items()}
    base = best[names[0]]
    return {"tokens": m, "gflop_s": {k: flops / t / 1e9 for k, t in best.items()},
            "vs_f_linear": {k: base / t for k, t in best.items()}, "max_abs_diff": diff}


class LinearTimer:
    """Accumulates the time spent inside a model's linear forwards (``nn.Linear`` and the
    small-row and prepacked CPU linears that replace them at load, each call counted once;
    hooks, no patching)."""

    def __init__(self, model: nn.Module, clock) -> None:
        self.clock, self.seconds, self._start = clock, 0.0, 0.0
        wrapped = {id(m.inner) for m in model.modules() if isinstance(m, PrepackedLinear)}
        for m in model.modules():
            if isinstance(m, (nn.Linear, SmallRowLinear, PrepackedLinear)) and id(m) not in wrapped:
                m.register_forward_pre_hook(self._enter)
                m.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        self._start = self.clock()

    def _leave(self, module, args, out) -> None:
        self.seconds += self.clock() - self._start


def prefill_row(n: int, llm: LLM, timer: LinearTimer, hf, vocab: int, clock, rounds: int) -> dict:
    ids = random_prompts(1, n, vocab, seed=n)[0]
    one = SamplingParams(max_tokens=1, temperature=0)
    best = {"ours": float("inf"), "ours_linear": float("inf"), "transformers": float("inf")}
    for r in range(rounds + 1):  # the first round warms both sides up and is not counted
        timer.seconds = 0.0
        t0 = clock()
        llm.generate(ids, one)
        ours = clock() - t0
        t0 = clock()
        with torch.inference_mode():
            hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        ref = clock() - t0
        if r > 0:
            best["ours"], best["transformers"] = min(best["ours"], ours), min(best["transformers"], ref)
            best["ours_linear"] = min(best["ours_linear"], timer.seconds)
    return {"tokens": n, "seconds": best, "linear_share": best["ours_linear"] / best["ours"],
            "ours_vs_transformers": best["transformers"] / best["ours"],
            "ceiling_gemm_only": best["transformers"] / best["ours_linear"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/prefill_bound")
    args = ap.parse_args()
    threads = args.threads or available_cores()
    clock, clock_name = (time.process_time, "CPU time") if threads == 1 else (time.perf_counter, "wall time")
    llm = LLM(None, dtype="float32", threads=threads, enable_prefix_cache=False, host_cache_gb=0,
              enable_disk_cache=False, max_num_batched_tokens=max(8192, *args.tokens),
              kv_cache_memory_gb=1.0, progress=False)
    model = llm.engine.runner.model
    weights = [m.weight for layer in model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.checkpoint_path, dtype=torch.float32).eval()
    timer = LinearTimer(model, clock)
    with torch.inference_mode():
        gemm = [gemm_row(weights, n, clock, args.rounds) for n in args.tokens]
    vocab = llm.engine.hf_config.vocab_size
    prefill = [prefill_row(n, llm, timer, hf, vocab, clock, args.rounds) for n in args.tokens]
    for p, g in zip(prefill, gemm):
        fastest = max(g["vs_f_linear"].values())
        s = p["seconds"]
        p["ceiling_fastest_gemm"] = s["transformers"] / (s["ours"] - s["ours_linear"] * (1 - 1 / fastest))
    res = {"cpu": lscpu_model(), "isa": cpu_isa().describe(), "threads": threads, "clock": clock_name,
           "rounds": args.rounds, "gemm": gemm, "prefill": prefill}
    names = list(gemm[0]["gflop_s"])
    lines = [f"CPU: {res['cpu']} ({res['isa']}), {threads} thread(s), {clock_name}, best of {args.rounds} "
             "interleaved rounds; SmolLM2-135M fp32", "",
             "| GEMM GFLOP/s (x vs F.linear; max |diff|), tokens | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for g in gemm:
        lines.append(f"| {g['tokens']} | " + " | ".join(
            f"{g['gflop_s'][k]:.1f} ({g['vs_f_linear'][k]:.2f}x; {g['max_abs_diff'][k]:.1e})" for k in names) + " |")
    lines += ["", "| prefill, tokens | ours s | in linears | transformers s | ours / transformers | "
              "ceiling, free non-GEMM | ceiling, fastest GEMM |", "|---|---:|---:|---:|---:|---:|---:|"]
    for p in prefill:
        s = p["seconds"]
        lines.append(f"| {p['tokens']} | {s['ours']:.2f} | {p['linear_share']:.0%} | {s['transformers']:.2f} | "
                     f"{p['ours_vs_transformers']:.2f}x | {p['ceiling_gemm_only']:.2f}x | "
                     f"{p['ceiling_fastest_gemm']:.2f}x |")
    write_summary(args.out, res, lines)


if __name__ == "__main__":
    main()
