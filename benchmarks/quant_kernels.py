"""Candidate quantized matmul kernels (our native one, and those that ship with torch) vs fp32
``F.linear``, interleaved in one process: the measurement behind ``deepinfer/quant/kernels.py``'s
choices and ``quant/linear.py``'s ``NATIVE_MAX_ROWS``.

Each row: one weight shape of SmolLM2-135M (N x K) and M activation rows; each cell: fp32 time /
kernel time (> 1: the kernel is faster), best of ``--rounds`` interleaved rounds. The ``native``
columns (its variants: int16 activations = ``native``, ``native-int8``, ``native-float``) call
the kernel at every M (the layer itself switches to ``dequant`` above ``NATIVE_MAX_ROWS`` rows).

``--decode``: batch-1 decode tok/s of SmolLM2 (the GGUF; int8 and int4) with each native variant,
engines run alternately round by round in one process. ``--profile``: where a batch-1 decode step
of the GGUF with int4 weights and the native kernel goes, op by op (torch profiler, self CPU time).
``--bandwidth``: the native kernel's time per call and the weight bytes it reads per second.
``--wide``: the 512-bit tiles (``csrc/qgemm_wide.h``) vs the 256-bit loop, oneDNN's bf16 linear
alongside: per call at M = 1 .. 64, and with ``--decode`` decode tok/s at batch 8 / 32.
``--vnni``: in a build with AVX-512 VNNI code, that code vs the AVX2 loop of the same build
(``native_linear(vnni=False)``), interleaved: per call, and with ``--decode`` decode tok/s at
batch 1 / 8 / 32 (the engine's layers switched to the AVX2 loop for the other side's rounds),
tinygemm's int4 alongside.

    python benchmarks/quant_kernels.py [--threads 1] [--rounds 5] [--quick] [--decode | --profile | --bandwidth] [--vnni | --wide]
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from deepinfer.hardware import lscpu_model
from deepinfer.quant.kernels import NATIVE_ACT_BITS, QuantPlan
from deepinfer.quant.linear import QuantizedLinear, quantize_weight
from deepinfer.quant.native import native_kernel, native_linear
from deepinfer.quant.packed import pack_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate|up, down, head


def per_call(fn, reps: int, clock=time.perf_counter) -> float:
    fn()
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def candidates(w: torch.Tensor) -> dict:
    """Kernel name -> callable of x (names with "bf16" take bf16 activations)."""
    out = {}
    if native_kernel().loaded:
        for scheme in ("int8", "int4"):
            q = pack_weight(quantize_weight(w, QuantPlan(scheme, "native")))
            for variant, act_bits in NATIVE_ACT_BITS.items():
                out[f"{variant} {scheme}"] = lambda x, q=q, a=act_bits: native_linear(x, q, None, a)
    out |= {"fbgemm int8 (lossy)": QuantizedLinear(quantize_weight(w, QuantPlan("int8", "fbgemm")), None,
                                                  "fbgemm", [w.shape[0]])}
    for scheme in ("int8", "int4"):
        out[f"dequant {scheme}"] = QuantizedLinear(quantize_weight(w, QuantPlan(scheme, "dequant")), None,
                                                   "dequant", [w.shape[0]])
    out["tinygemm int4 (bf16 in)"] = QuantizedLinear(quantize_weight(w, QuantPlan("int4", "tinygemm")),
                                                     None, "tinygemm", [w.shape[0]])
    q8 = quantize_weight(w, QuantPlan("int8", "fbgemm"))
    out["_weight_int8pack_mm (fp32 in)"] = lambda x: torch.ops.aten._weight_int8pack_mm(
        x, q8.codes, q8.scale[:, 0])
    return out


def decode(threads: int, rounds: int, tokens: int) -> None:
    """Batch-1 decode tok/s per native variant and scheme, the engines alternating round by round."""
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    engines = {f"{scheme} {variant}": LLM(None, quantization=scheme, quantization_kernel=variant, threads=threads,
                                          kv_cache_memory_gb=0.1, progress=False, host_cache_gb=0,
                                          enable_disk_cache=False, enable_prefix_cache=False)
               for scheme in ("int8", "int4") for variant in NATIVE_ACT_BITS}
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompt = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28]]
    best = dict.fromkeys(engines, 0.0)
    for _ in range(rounds):
        for name, llm in engines.items():
            llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))  # warm
            t0 = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            best[name] = max(best[name], len(out.token_ids) / (time.perf_counter() - t0))
    print("| scheme kernel | batch-1 decode tok/s |\n|---|---:|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} |")


@contextmanager
def native_args(**kwargs):
    """The quantized layers call the native kernel with ``kwargs`` (``vnni=False``: the AVX2 integer
    loop; ``wide=False``: no 512-bit tiles) while inside; none: as they are."""
    import deepinfer.quant.linear as layers

    plain = layers.native_linear
    if kwargs:
        layers.native_linear = lambda *args: plain(*args, **kwargs)
    try:
        yield
    finally:
        layers.native_linear = plain


def decode_vnni(threads: int, rounds: int, tokens: int) -> None:
    """Decode tok/s at batch 1 / 8 / 32 of the VNNI code vs the AVX2 loop (native, native-int8;
    tinygemm's int4 too), all sides alternating round by round in one process."""
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    variants = [(s, k) for s in ("int8", "int4") for k in ("native", "native-int8")] + [("int4", "tinygemm")]
    engines = {(s, k): LLM(None, quantization=s, quantization_kernel=k, threads=threads, kv_cache_memory_gb=0.3,
                           progress=False, host_cache_gb=0, enable_disk_cache=False, enable_prefix_cache=False)
               for s, k in variants}
    first = next(iter(engines.values())).engine
    print(f"model dtype {first.runner.dtype}; plans: "
          + "; ".join(f"{s} {k}: {llm.engine.runner.quant_plan.describe()}" for (s, k), llm in engines.items()))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    sides = [(v, code) for v in variants for code in (("vnni", "avx2") if v[1] != "tinygemm" else ("-",))]
    print("| scheme | kernel | batch | VNNI tok/s | AVX2 loop tok/s | VNNI / AVX2 |\n|---|---|---:|---:|---:|---:|")
    for batch in (1, 8, 32):
        prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28 + i] for i in range(batch)]
        best = dict.fromkeys(sides, 0.0)
        for _ in range(rounds):
            for (v, code) in sides:
                with native_args(**({"vnni": False} if code == "avx2" else {})):
                    engines[v].generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm
                    t0 = time.perf_counter()
                    outs = engines[v].generate(prompts, params)
                    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
                best[v, code] = max(best[v, code], rate)
        for v in variants:
            if v[1] == "tinygemm":
                print(f"| {v[0]} | tinygemm | {batch} | {best[v, '-']:.1f} | | |")
            else:
                a, b = best[v, "vnni"], best[v, "avx2"]
                print(f"| {v[0]} | {v[1]} | {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


def per_call_vnni(shapes: list[tuple[int, int]], rounds: int, reps: int) -> None:
    """Per call, thread CPU time: the AVX2 loop's time / the VNNI code's, int16 and int8 activations."""
    print("| weight | scheme | M | int16: AVX2 / VNNI | int8 (native-int8): AVX2 / VNNI |\n|---|---|---:|---:|---:|")
    for n, k in shapes:
        w = torch.randn(n, k) / k ** 0.5
        for scheme in ("int8", "int4"):
            q = pack_weight(quantize_weight(w, QuantPlan(scheme, "native")))
            for m in (1, 8, 32):
                x = torch.randn(m, k)
                fns = {(a, v): (lambda a=a, v=v: native_linear(x, q, None, a, v)) for a in (16, 8) for v in (False, True)}
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(rounds):
                    for key, fn in fns.items():
                        best[key] = min(best[key], per_call(fn, reps, time.thread_time))
                print(f"| {n}x{k} | {scheme} | {m} | {best[16, False] / best[16, True]:.2f}x | "
                      f"{best[8, False] / best[8, True]:.2f}x |")


def decode_wide(threads: int, rounds: int, tokens: int) -> None:
    """Decode tok/s at batch 8 / 32, int8 and int4 (native kernel), with the 512-bit tiles vs
    without (the 256-bit loop), bf16 weights alongside; all sides alternating round by round."""
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    common = dict(threads=threads, kv_cache_memory_gb=0.3, progress=False, host_cache_gb=0, enable_disk_cache=False,
                  enable_prefix_cache=False, speculative_config=None)
    engines = {s: LLM(None, quantization=s, **common) for s in ("int8", "int4")} | {"bf16": LLM(None, **common)}
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    sides = [(s, wide) for s in ("int8", "int4") for wide in (True, False)] + [("bf16", True)]
    print("| batch | int8 wide | int8 256-bit | wide / 256-bit | int4 wide | int4 256-bit | wide / 256-bit | bf16 |"
          "\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (8, 32):
        prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28 + i] for i in range(batch)]
        best = dict.fromkeys(sides, 0.0)
        for _ in range(rounds):
            for s, wide in sides:
                with native_args(**({} if wide else {"wide": False})):
                    engines[s].generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm
                    t0 = time.perf_counter()
                    outs = engines[s].generate(prompts, params)
                    best[s, wide] = max(best[s, wide], sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        cells = [f"{best[s, True]:.1f} | {best[s, False]:.1f} | {best[s, True] / best[s, False]:.2f}x" for s in ("int8", "int4")]
        print(f"| {batch} | {cells[0]} | {cells[1]} | {best['bf16', True]:.1f} |")


def per_call_wide(shapes: list[tuple[int, int]], rounds: int, reps: int) -> None:
    """Per call, process CPU time, int16 activations: the 256-bit loop's time / the 512-bit tiles',
    and oneDNN's bf16 linear on a packed bf16 weight (the bf16 model's) / the tiles', at M = 1 .. 64."""
    from deepinfer.layers.prepacked_linear import PACK_ROWS, packed_linear

    print("| weight | scheme | M | 256-bit / wide | bf16 oneDNN / wide |\n|---|---|---:|---:|---:|")
    for n, k in shapes:
        w = torch.randn(n, k) / k ** 0.5
        bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), PACK_ROWS)
        for scheme in ("int8", "int4"):
            q = pack_weight(quantize_weight(w, QuantPlan(scheme, "native")))
            for m in (1, 4, 8, 16, 17, 32, 64):
                x = torch.randn(m, k).bfloat16()
                fns = {"wide": lambda: native_linear(x, q, None, 16), "256": lambda: native_linear(x, q, None, 16, wide=False),
                       "bf16": lambda: packed_linear(x, bf16, None)}
                best = dict.fromkeys(fns, float("inf"))
                for _ in range(rounds):
                    for key, fn in fns.items():
                        best[key] = min(best[key], per_call(fn, max(1, reps * 4096 // (n * m) + 1), time.process_time))
                print(f"| {n}x{k} | {scheme} | {m} | {best['256'] / best['wide']:.2f}x | {best['bf16'] / best['wide']:.2f}x |")


def profile(threads: int, tokens: int) -> None:
    """Self CPU time per op over ``tokens`` batch-1 decode steps (GGUF, int4, native kernel)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(None, quantization="int4", threads=threads, kv_cache_memory_gb=0.1, progress=False,
              host_cache_gb=0, enable_disk_cache=False, enable_prefix_cache=False)
    prompt = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28]]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        wall = time.perf_counter() - t0
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{tokens} steps, {wall / tokens * 1e3:.1f} ms per step under the profiler\n| op | share | ms per step |")
    for e in events[:12]:
        print(f"| {e.key} | {e.self_cpu_time_total / total:.1%} | {e.self_cpu_time_total / 1e3 / tokens:.2f} |")


def bandwidth(shapes: list[tuple[int, int]], rounds: int, reps: int) -> None:
    """Native kernel (int16 activations) per call, and its weight bytes (codes, scales, offsets) / time."""
    print("| weight | scheme | M | us per call | weight GB/s |\n|---|---|---|---:|---:|")
    for n, k in shapes:
        w = torch.randn(n, k) / k ** 0.5
        for scheme in ("int8", "int4"):
            q = pack_weight(quantize_weight(w, QuantPlan(scheme, "native")))
            nbytes = sum(t.numel() * t.element_size() for t in (q.codes, q.scale, q.offset) if t is not None)
            for m in (1, 4, 8, 32):
                x = torch.randn(m, k)
                best = min(per_call(lambda: native_linear(x, q, None, 16), reps) for _ in range(rounds))
                print(f"| {n}x{k} | {scheme} | {m} | {best * 1e6:.0f} | {nbytes / best / 1e9:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="one shape, one round (a smoke run)")
    ap.add_argument("--decode", action="store_true", help="batch-1 decode tok/s per native variant instead")
    ap.add_argument("--profile", action="store_true", help="where a batch-1 int4 decode step goes, op by op")
    ap.add_argument("--bandwidth", action="store_true", help="native kernel time per call and weight GB/s")
    ap.add_argument("--vnni", action="store_true", help="the VNNI code vs the AVX2 loop (per call; with --decode, tok/s)")
    ap.add_argument("--wide", action="store_true",
                    help="the 512-bit tiles vs the 256-bit loop, bf16 alongside (per call; with --decode, tok/s)")
    ap.add_argument("--tokens", type=int, default=64, help="--decode / --profile: tokens per round")
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.quick:
        args.rounds, args.reps = 1, 2
    torch.set_num_threads(args.threads)
    if not native_kernel().loaded:
        print(f"native kernel: {native_kernel().error}")
    if args.wide:
        print(f"CPU: {lscpu_model()}, kernel {native_kernel().isa}, {args.threads} thread(s), "
              f"best of {args.rounds} alternating rounds")
        if args.decode:
            decode_wide(args.threads, 1 if args.quick else args.rounds, 8 if args.quick else args.tokens)
        else:
            per_call_wide(shapes, args.rounds, args.reps)
        return
    if args.vnni:
        print(f"CPU: {lscpu_model()}, kernel {native_kernel().isa}, {args.threads} thread(s), "
              f"best of {args.rounds} alternating rounds")
        if native_kernel().isa != "avx512-vnni":
            print("no AVX-512 VNNI code in this build: nothing to compare")
        elif args.decode:
            decode_vnni(args.threads, 1 if args.quick else args.rounds, 8 if args.quick else args.tokens)
        else:
            per_call_vnni(shapes, args.rounds, max(args.reps, 50))  # calls of ~20 us: many per timing
        return
    if args.decode:
        print(f"CPU: {lscpu_model()}, {args.threads} thread(s), best of {args.rounds} alternating rounds")
        decode(args.threads, 1 if args.quick else args.rounds, 8 if args.quick else args.tokens)
        return
    if args.profile or args.bandwidth:
        print(f"CPU: {lscpu_model()}, {args.threads} thread(s)")
        if args.profile:
            profile(args.threads, 8 if args.quick else args.tokens)
        else:
            bandwidth(shapes, args.rounds, args.reps)
        return
    print(f"CPU: {lscpu_model()}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s); fp32 time / kernel time")
    rows = []
    with torch.inference_mode():
        for n, k in shapes:
            w = torch.randn(n, k) / k ** 0.5
            kernels = candidates(w)
            for m in (1, 8, 32, 128, 512):
                x = torch.randn(m, k)
                xb = x.bfloat16()
                fns = [lambda: F.linear(x, w)] + [
                    (lambda f=f: f(xb)) if "bf16" in name else (lambda f=f: f(x)) for name, f in kernels.items()]
                best = [float("inf")] * len(fns)
                for _ in range(args.rounds):
                    for i, fn in enumerate(fns):
                        best[i] = min(best[i], per_call(fn, args.reps))
                rows.append((f"{n}x{k}", m, [best[0] / b for b in best[1:]]))
    names = list(candidates(torch.randn(32, 32)))
    print("| weight | M | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for shape, m, ratios in rows:
        print(f"| {shape} | {m} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    main()
