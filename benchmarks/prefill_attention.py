"""Where a bf16 prefill's time goes, and our prefill attention kernel against torch's path (issues 11, 17).

Three parts, one run:
- ``kernel``: one layer's attention at SmolLM2-135M's shapes (9 q heads, 3 kv heads, head dim
  64, page size 16): 80- and 320-token tails over 7,920 / 7,680 cached tokens (issue 17's 99% and
  96% hits of an 8K prompt) and cold 512 / 2,048-token chunks,
  our kernel (``layers/native_prefill.py``) and the torch path (page gather + flash SDPA)
  interleaved, best of the rounds; GFLOP/s count the visible (causal) products.
- ``profile``: the torch profiler over the engine's forward of a cold 2,048-token prompt and of
  the 80- and 320-token tails after 7,920 / 7,680 L1-cached tokens, each with the kernel
  (``auto``) and with ``--attention-backend torch``: self CPU time split into attention, linears
  and the rest.
- ``engine``: whole prefills through ``LLM.generate`` (one output token), bf16 with the kernel,
  bf16 with ``--attention-backend torch`` and transformers bf16, interleaved round by round,
  best round each; and the TTFT of an 80-token tail after a 7,920-token L1 hit, kernel vs torch.

Shared machine: use the ratios, not the absolute times. ``--threads 1`` times the kernel on the
thread's CPU clock (robust to neighbours); more threads use the wall clock.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import deepinfer  # noqa: E402, F401  (first: sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402

from deepinfer.hardware import lscpu_model  # noqa: E402
from deepinfer.layers.batch_rows_linear import LINEAR_OP as BATCH_ROWS_OP  # noqa: E402
from deepinfer.layers.chunk_attention import prefix_then_causal  # noqa: E402
from deepinfer.layers.native_prefill import native_prefill, native_prefill_kernel  # noqa: E402
from deepinfer.quant.native import LINEAR_OP as QUANT_OP  # noqa: E402
from deepinfer.threads import apply_thread_policy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core import fastest, random_prompts, timed  # noqa: E402

HQ, HKV, D, PS = 9, 3, 64, 16
ATTENTION = ("deepinfer_prefill::prefill_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")
LINEAR = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "deepinfer_rows::",
          BATCH_ROWS_OP, QUANT_OP)


def torch_path(q, k, v, pages, start):
    """What ``paged_attention`` runs without the kernel: gather the pages, flash SDPA."""
    n = start + q.shape[0]
    kk = k.index_select(0, pages).flatten(0, 1)[:n].transpose(0, 1)[None]
    vv = v.index_select(0, pages).flatten(0, 1)[:n].transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]
    if start:
        return prefix_then_causal(qh, kk, vv, start, 0.125)
    return torch.nn.functional.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=0.125,
                                                            enable_gqa=True)


def kernel_rows(rounds: int, clock) -> list[str]:
    rows = ["| chunk | ours ms | ours GFLOP/s | torch ms | torch GFLOP/s | torch / ours |", "|---|---|---|---|---|---|"]
    for start, T in [(7920, 80), (7680, 320), (0, 512), (0, 2048)]:
        n = start + T
        num_pages = -(-n // PS)
        k = torch.randn(num_pages + 4, PS, HKV, D).bfloat16()
        v = torch.randn_like(k)
        pages = torch.randperm(num_pages + 4)[:num_pages]
        q = torch.randn(T, HQ, D).bfloat16()
        fns = [lambda: native_prefill(q, k, v, pages, start, 0.125), lambda: torch_path(q, k, v, pages, start)]
        best = [float("inf")] * 2
        for f in fns:
            f()
        for _ in range(rounds):  # interleaved: ours, torch, ours, torch...
            for i, f in enumerate(fns):
                t = clock()
                f()
                best[i] = min(best[i], clock() - t)
        flops = 4 * T * HQ * D * (start + (T + 1) / 2)
        rows.append(f"| {T} after {start} | {best[0] * 1e3:.1f} | {flops / best[0] / 1e9:.0f} | {best[1] * 1e3:.1f} | "
                    f"{flops / best[1] / 1e9:.0f} | {best[1] / best[0]:.2f}x |")
    return rows


def split(llm, prompt: list[int]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.sampling_params import SamplingParams

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - t0
    parts = {"attention": 0.0, "linears": 0.0, "rest": 0.0}
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        key = "attention" if e.key in ATTENTION else "linears" if e.key.startswith(LINEAR) else "rest"
        parts[key] += us / 1e6
    total = sum(parts.values())
    return {"wall": wall, **{k: v / total for k, v in parts.items()}}


def profile_rows(model: str | None) -> list[str]:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    cached = torch.randint(100, 40000, (7920,), generator=g).tolist()
    rows = ["| case | backend | wall s | attention | linears | rest |", "|---|---|---|---|---|---|"]
    for backend in ("auto", "torch"):
        llm = LLM(model, progress=False, dtype="bfloat16", host_cache_gb=0, enable_disk_cache=False,
                  attention_backend=backend, max_num_batched_tokens=2048)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(torch.randint(100, 40000, (96,), generator=g).tolist(), one)  # first-call costs
        cases = [("2,048 cold", torch.randint(100, 40000, (2048,), generator=g).tolist())]
        llm.generate(cached + torch.randint(100, 40000, (80,), generator=g).tolist(), one)  # fill L1
        cases.append(("80 after 7,920 (L1)", cached + torch.randint(100, 40000, (80,), generator=g).tolist()))
        tail = torch.randint(100, 40000, (320,), generator=g).tolist()
        cases.append(("320 after 7,680 (L1)", cached[:7680] + tail))
        for name, prompt in cases:
            s = split(llm, prompt)
            rows.append(f"| {name} | {backend} | {s['wall']:.3f} | {s['attention']:.0%} | {s['linears']:.0%} | "
                        f"{s['rest']:.0%} |")
        del llm
    return rows


def engine_rows(model: str | None, lengths: list[int], rounds: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llms = {backend: LLM(model, progress=False, dtype="bfloat16", host_cache_gb=0, enable_disk_cache=False,
                         attention_backend=backend, max_num_batched_tokens=8192, speculative_config=None)
            for backend in ("auto", "torch")}
    first = llms["auto"].engine
    hf = AutoModelForCausalLM.from_pretrained(first.checkpoint_path, dtype=torch.bfloat16).eval()
    vocab = first.hf_config.vocab_size
    for llm in llms.values():
        llm.generate(random_prompts(1, 16, vocab, seed=7)[0], one)  # first-call costs
    rows = ["| prefill tokens | ours, kernel tok/s | ours, torch attention tok/s | transformers tok/s | "
            "kernel / torch | kernel / transformers |", "|---|---|---|---|---|---|"]
    for n in lengths:
        prompts = iter(random_prompts(3 * rounds, n, vocab, seed=n))  # fresh each call: no prefix hits

        def reference():
            x = torch.tensor([next(prompts)])
            with torch.inference_mode():
                return timed(lambda: hf(x, use_cache=False, logits_to_keep=1))

        fns = [lambda llm=llm: (lambda ids: timed(lambda: llm.generate(ids, one)))(next(prompts))
               for llm in llms.values()] + [reference]
        t = fastest(fns, rounds)
        rows.append(f"| {n} | {n / t[0]:.1f} | {n / t[1]:.1f} | {n / t[2]:.1f} | {t[1] / t[0]:.2f}x | "
                    f"{t[2] / t[0]:.2f}x |")
    cached = random_prompts(1, 7920, vocab, seed=1)[0]
    tails = iter(random_prompts(2 * rounds + 2, 80, vocab, seed=2))
    for llm in llms.values():
        llm.generate(cached + next(tails), one)  # the 7,920 tokens into L1
    fns = [lambda llm=llm: llm.generate(cached + next(tails), one)[0].ttft for llm in llms.values()]
    t = fastest(fns, rounds)
    rows += ["", "| 80-token tail after 7,920 L1-cached | kernel TTFT s | torch attention TTFT s | torch / kernel |",
             "|---|---|---|---|", f"| bf16 | {t[0]:.3f} | {t[1]:.3f} | {t[1] / t[0]:.2f}x |"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M)")
    ap.add_argument("--only", choices=("kernel", "profile", "engine"), action="append")
    ap.add_argument("--quick", action="store_true", help="2 rounds; engine: 512 tokens only")
    args = ap.parse_args()
    apply_thread_policy(args.threads)
    only = set(args.only or ("kernel", "profile", "engine"))
    print(f"CPU: {lscpu_model()}, {args.threads} threads, kernel: {native_prefill_kernel()}")
    if "kernel" in only:
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        print(f"one layer, best of {2 if args.quick else args.rounds} interleaved rounds, "
              f"{'thread CPU time' if args.threads == 1 else 'wall time'}")
        print("\n".join(kernel_rows(2 if args.quick else args.rounds, clock)))
    if "profile" in only:
        print("forward of one prompt, torch profiler, self CPU time shares")
        print("\n".join(profile_rows(args.model)))
    if "engine" in only:
        print(f"whole prefills, best of {2 if args.quick else args.rounds} interleaved rounds, wall time")
        print("\n".join(engine_rows(args.model, [512] if args.quick else [512, 2048], 2 if args.quick else args.rounds)))


if __name__ == "__main__":
    main()
