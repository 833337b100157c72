"""Execution benchmark (issue 11): decode and prefill speed per dtype / quantization, side by side
with transformers (its best dtype here) and llama.cpp (llama-cpp-python, the same Q4_1 GGUF, the
same threads), plus a contention run (batch-1 decode with one competing busy process / quiet).

Every measurement point runs all sides interleaved, round by round, and keeps each side's best
round (``core.fastest``), so load from other processes hits all sides alike. llama.cpp runs in its
own venv, one subprocess per measurement (its load time is not counted). Batched decode is not
offered by llama-cpp-python's API, so its batch 8/32 cells stay empty.

    python benchmarks/execution.py [--quick] [--threads N] [--llamacpp-python PATH] [--only prefill]
        [--sides bf16 fp32] [--lengths 512 2048] [--batches 8 32]
    python benchmarks/execution.py --only decode --batches 1 --sides int4   # batch 1 vs llama.cpp only
    python benchmarks/execution.py --only decode --batches 8 32 --sides bf16  # batched decode vs transformers

The prefill section also runs fp32 in the engine's default 2,048-token chunks (chunks after the
first attend over the cached pages of the earlier ones) and a 200-token tail after a 2,048-token
cached prefix (the agent workload's prefills), against transformers over a copy of its own
cache of the same prefix.

Writes results/execution/summary.json and summary.md; prints the CPU model with the results.
"""

from __future__ import annotations

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import torch
from core import fastest, random_prompts, timed, write_summary
from llamacpp_cache import DEFAULT_PEER, peer_python
from transformers import AutoModelForCausalLM, DynamicCache

from deepinfer.hardware import auto_dtype, cpu_isa, lscpu_model
from deepinfer.llm import LLM
from deepinfer.loader import default_model_path
from deepinfer.sampling_params import SamplingParams
from deepinfer.threads import available_cores

# Runs in the peer's venv: prints the seconds of one prefill or of `decode` single-token steps.
LLAMACPP = """
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_threads=a["threads"], n_batch=512, verbose=False)
ids = a["ids"]
if a["decode"]:
    llm.eval(ids)
    t0 = time.perf_counter()
    for i in range(a["decode"]):
        llm.eval([ids[i % len(ids)]])
else:
    t0 = time.perf_counter()
    llm.eval(ids)
print(time.perf_counter() - t0)
"""


def engine_sides(threads: int, kv_gb: float, only: list[str] | None = None) -> dict[str, dict]:
    """DeepInfer configurations: fp32, bf16 where the CPU has it natively, int8 and int4 (auto:
    the native kernel on CPU where it builds; int4 from the GGUF's Q4_1 blocks directly), and the
    fast-but-lossy fbgemm int8 kernel for reference."""
    sides = {"fp32": dict(dtype="float32")}
    if cpu_isa().native_bf16:
        sides["bf16"] = dict(dtype="bfloat16")
    sides["int8"] = dict(quantization="int8")
    sides["int4"] = dict(quantization="int4")
    sides["int8 fbgemm (lossy)"] = dict(quantization="int8", quantization_kernel="fbgemm")
    # speculation off: these cells measure the cost of each computed token (benchmarks/spec.py
    # measures what speculation adds on top)
    common = dict(threads=threads, enable_prefix_cache=False, host_cache_gb=0, enable_disk_cache=False,
                  max_num_batched_tokens=8192, kv_cache_memory_gb=kv_gb, progress=False,
                  speculative_config=None)
    return {name: {**common, **kw} for name, kw in sides.items() if only is None or name in only}


SIDES = ("fp32", "bf16", "int8", "int4", "int8 fbgemm (lossy)")


def llamacpp(peer: Path, gguf: Path, threads: int, ids: list[int], decode: int) -> float:
    args = dict(gguf=str(gguf), n_ctx=len(ids) + decode + 16, threads=threads, ids=ids, decode=decode)
    out = subprocess.run([str(peer), "-c", LLAMACPP, json.dumps(args)], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def prefill_row(n: int, llms: dict[str, LLM], hf, peer: Path | None, gguf: Path, threads: int,
                vocab: int, rounds: int) -> dict:
    ids = random_prompts(1, n, vocab, seed=n)[0]
    one = SamplingParams(max_tokens=1, temperature=0)
    fns = [lambda llm=llm: timed(lambda: llm.generate(ids, one)) for llm in llms.values()]

    def reference():
        with torch.inference_mode():
            return timed(lambda: hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1))

    fns.append(reference)
    if peer is not None:
        fns.append(lambda: llamacpp(peer, gguf, threads, ids, 0))
    best = fastest(fns, rounds)
    names = list(llms) + ["transformers"] + (["llama.cpp"] if peer else [])
    return {"tokens": n, "tok_s": {k: n / t for k, t in zip(names, best)}}


def tail_row(prefix: int, tail: int, llm: LLM, hf, vocab: int, rounds: int) -> dict:
    """A ``tail``-token prompt end after a cached ``prefix``: ours from the prefix cache (a fresh
    tail each call, so only the prefix hits), transformers from a copy of its cache of the prefix
    (copied outside the timing)."""
    ids = random_prompts(1, prefix, vocab, seed=prefix)[0]
    tails = iter(random_prompts(2 * rounds + 2, tail, vocab, seed=prefix + tail))
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(ids, one)  # caches the prefix
    with torch.inference_mode():
        cache = hf(torch.tensor([ids]), use_cache=True, cache=DynamicCache(), logits_to_keep=1).cache

    def reference():
        kv, x = copy.deepcopy(cache), torch.tensor([next(tails)])
        with torch.inference_mode():
            return timed(lambda: hf(x, cache=kv, use_cache=True, logits_to_keep=1))

    def ours():
        prompt = ids + next(tails)
        return timed(lambda: llm.generate(prompt, one))

    best = fastest([ours, reference], rounds)
    return {"tokens": f"{tail} after {prefix} cached",
            "tok_s": {"fp32": tail / best[0], "transformers": tail / best[1]}}


def decode_fns(b: int, llms: dict[str, LLM], hf, vocab: int, new_tokens: int) -> dict:
    """Per side: seconds for ``new_tokens`` minus seconds for 1 (decode without the prefill)."""
    prompts = random_prompts(b, 64, vocab, seed=1000 + b)
    x = torch.tensor(prompts)

    def ours(llm, n):
        return timed(lambda: llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0,
                                                                  ignore_eos=True)))

    def reference(n):
        with torch.inference_mode():
            return timed(lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                             pad_token_id=0, eos_token_id=None))

    fns = {k: (lambda n, llm=llm: ours(llm, n)) for k, llm in llms.items()}
    fns["transformers"] = reference
    return fns


def decode_row(b: int, llms, hf, peer, gguf, threads, vocab, new_tokens, rounds) -> dict:
    fns = decode_fns(b, llms, hf, vocab, new_tokens)
    calls = [lambda f=f: f(new_tokens) - f(1) for f in fns.values()]
    names = list(fns)
    if peer is not None and b == 1:
        ids = random_prompts(1, 64, vocab, seed=1000)[0]
        calls.append(lambda: llamacpp(peer, gguf, threads, ids, new_tokens - 1))
        names.append("llama.cpp")
    best = fastest(calls, rounds)
    return {"batch": b, "tok_s": {k: b * (new_tokens - 1) / t for k, t in zip(names, best)}}


def contention_row(llm: LLM, peer, gguf, threads, vocab, new_tokens, rounds) -> dict:
    """Batch-1 decode quiet and next to one busy process, interleaved; ratio busy / quiet."""
    f = decode_fns(1, {"deepinfer": llm}, None, vocab, new_tokens)["deepinfer"]
    sides = {"deepinfer": lambda: f(new_tokens) - f(1)}
    if peer is not None:
        ids = random_prompts(1, 64, vocab, seed=1000)[0]
        sides["llama.cpp"] = lambda: llamacpp(peer, gguf, threads, ids, new_tokens - 1)
    quiet = {k: float("inf") for k in sides}
    busy = dict(quiet)
    for _ in range(rounds):
        for k, fn in sides.items():
            quiet[k] = min(quiet[k], fn())
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for k, fn in sides.items():
                busy[k] = min(busy[k], fn())
        finally:
            hog.kill()
            hog.wait()
    return {k: {"quiet_tok_s": (new_tokens - 1) / quiet[k], "busy_tok_s": (new_tokens - 1) / busy[k],
                "ratio": quiet[k] / busy[k]} for k in sides}


def table(title: str, key: str, rows: list[dict], names: list[str]) -> list[str]:
    lines = [f"| {title} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rows:
        cells = [f"{r['tok_s'][k]:.1f}" if k in r["tok_s"] else "–" for k in names]
        lines.append(f"| {r[key]} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llamacpp-python", default=str(DEFAULT_PEER),
                    help="python of a venv with llama-cpp-python ('' to skip llama.cpp)")
    ap.add_argument("--only", choices=["prefill", "decode", "contention"], action="append",
                    help="run only these sections (repeatable; default: all)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="decode batch sizes (default: 1 8 32; --quick: 1 8)")
    ap.add_argument("--sides", nargs="+", default=None, choices=SIDES,
                    help="DeepInfer configurations to run (default: all this CPU has)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="prefill lengths (default: 512 2048 8000; --quick: 512)")
    ap.add_argument("--out", default="results/execution")
    args = ap.parse_args()
    if args.sides and "contention" in (args.only or ["contention"]) and not {"bf16", "fp32"} & set(args.sides):
        ap.error("the contention run measures the default dtype: add --sides bf16 (or fp32), or --only decode")
    threads = args.threads or available_cores()
    lengths, batches, new_tokens = ([512], [1, 8], 8) if args.quick else ([512, 2048, 8000], [1, 8, 32], 32)
    batches = args.batches or batches
    lengths = args.lengths or lengths
    peer = peer_python(args.llamacpp_python)
    gguf = default_model_path()
    kv_gb = 0.25 if args.quick else 1.0
    llms = {name: LLM(None, **kw) for name, kw in engine_sides(threads, kv_gb, args.sides).items()}
    first = next(iter(llms.values())).engine
    hf_dtype = auto_dtype(torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(first.checkpoint_path, dtype=hf_dtype).eval()
    vocab = first.hf_config.vocab_size
    warm = random_prompts(2, 16, vocab, seed=7)  # first calls pay one-time costs (kernel loads, pools)
    for llm in llms.values():
        for prompts in (warm[:1], warm):
            llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    res = {"cpu": lscpu_model(), "isa": cpu_isa().describe(), "threads": threads, "rounds": args.rounds,
           "transformers_dtype": str(hf_dtype), "startup": {k: v.engine.startup_summary for k, v in llms.items()}}
    only = set(args.only or ["prefill", "decode", "contention"])
    chunked = "fp32 (2,048-token chunks)"
    names = list(llms) + [chunked, "transformers", "llama.cpp"]
    lines = [f"CPU: {res['cpu']} ({res['isa']}), {threads} threads, best of {args.rounds} interleaved "
             f"rounds; transformers in {hf_dtype}",
             "kernels: " + "; ".join(f"{k}: {v.engine.runner.quant_plan.describe()}" for k, v in llms.items()
                                     if v.engine.runner.quant_plan.scheme != "none"), ""]
    if "prefill" in only:
        fp32 = engine_sides(threads, kv_gb)["fp32"]
        sides = {**llms, chunked: LLM(None, **{**fp32, "max_num_batched_tokens": 2048})} if "fp32" in llms else llms
        res["prefill"] = [prefill_row(n, sides, hf, peer, gguf, threads, vocab, args.rounds) for n in lengths]
        if "fp32" in llms:
            res["prefill"].append(tail_row(lengths[0] if args.quick else 2048, 200,
                                           LLM(None, **{**fp32, "enable_prefix_cache": True}), hf, vocab,
                                           args.rounds))
        lines += table("prefill tok/s, tokens", "tokens", res["prefill"], names) + [""]
    if "decode" in only:
        res["decode"] = [decode_row(b, llms, hf, peer, gguf, threads, vocab, new_tokens, args.rounds)
                         for b in batches]
        lines += table("decode tok/s, batch", "batch", res["decode"], list(llms) + ["transformers", "llama.cpp"])
        lines += [""]
    if "contention" in only:
        default = llms.get("bf16", llms.get("fp32", next(iter(llms.values()))))  # what --dtype auto picks
        res["contention"] = contention_row(default, peer, gguf, threads, vocab, new_tokens, args.rounds)
        lines += ["| contention (batch-1 decode) | quiet tok/s | one busy neighbour tok/s | busy / quiet |",
                  "|---|---|---|---|"]
        lines += [f"| {k} | {v['quiet_tok_s']:.1f} | {v['busy_tok_s']:.1f} | {v['ratio']:.2f}x |"
                  for k, v in res["contention"].items()]
    write_summary(args.out, res, lines)


if __name__ == "__main__":
    main()
