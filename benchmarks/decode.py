"""Decode-step benchmark: one batched decode step of SmolLM2 at a given batch size and context.

The KV pool is filled with random values and each sequence's page table points at ``--context``
cached tokens, so a step costs exactly what a decode at that context costs (attention does not
depend on the values) without prefilling batch x context tokens first. Every step decodes the
same position again, so the context stays fixed.

    python benchmarks/decode.py                                  # batch 1/8/32 at 2K context
    python benchmarks/decode.py --compare /path/to/other/checkout  # A/B vs another revision, interleaved
    python benchmarks/decode.py --backends auto torch --quantization int4  # native decode attention vs gather + SDPA
    python benchmarks/decode.py --profile --batches 1            # where the step goes (torch.profiler)
    python benchmarks/decode.py --device cuda --prefill 512 2048 8192  # also prefill tokens/s

With ``--compare`` each round runs both revisions in fresh processes, one after the other, and
keeps each side's best round, so a burst of load from other processes hits both alike; several
``--backends`` take turns step by step within each process. ``ratio`` is each side's tokens/s
over the first side's (``cpu_ratio``: the same from the process's CPU seconds per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def measure(batch: int, context: int, steps: int, threads: int, profile: bool,
            device: str = "auto", backends: tuple[str, ...] = ("auto",), quantization: str = "none") -> dict:
    """Seconds per decode step (best of ``steps``) of the deepinfer importable here, per decode
    attention backend; the backends take turns step by step in this one process (the runner
    reads ``config.attention_backend`` at each step; a checkout without it ignores it)."""
    import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
    import torch

    from deepinfer.llm import LLM
    from deepinfer.request import Request
    from deepinfer.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    ps = 16
    pages_per_seq = -(-(context + 1) // ps)
    llm = LLM(num_pages=(batch + 1) * (pages_per_seq + 8) + 2, max_model_len=context + 64,
              host_cache_gb=0, enable_disk_cache=False, progress=False, page_size=ps, device=device,
              quantization=quantization, threads=threads)  # the engine sets its thread count itself
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(0)
    for buf in runner.pool.owned_buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float32))
    params = SamplingParams(max_tokens=1, temperature=0)
    items = []
    for b in range(batch):
        req = Request(f"r{b}", torch.randint(0, 40000, (context + 1,), generator=gen).tolist(), params)
        req.pages = runner.pool.allocator.alloc(pages_per_seq)
        req.num_computed_tokens = context
        items.append((req, 1))
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    def step() -> None:  # forward and sample; returns once the tokens reached the host
        sampled, logits = runner.forward(items)
        runner.sample(sampled, logits)

    wall = {b: float("inf") for b in backends}
    cpu = dict(wall)  # CPU seconds of the process: less inflated than wall time by other processes
    for i in range(steps + 1):
        for backend in backends:
            runner.config.attention_backend = backend
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if i:  # the first round warms up
                wall[backend] = min(wall[backend], time.perf_counter() - t0)
                cpu[backend] = min(cpu[backend], time.process_time() - c0)
    out = {"batch": batch, "context": context, "step_s": wall, "cpu_s": cpu}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
        out["matmul_share"] = mm / total
        out["profile"] = events.table(sort_by="self_cpu_time_total", row_limit=15)
    return out


MATMUL_OPS = ("aten::mm", "aten::addmm", "deepinfer_quant::linear")


def prefill_rates(lengths: list[int], device: str, rounds: int) -> list[dict]:
    """Prefill tokens/s of one prompt of each length (prefix cache off), best of ``rounds``."""
    import torch

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(enable_prefix_cache=False, progress=False, device=device,
              max_model_len=max(lengths) + 8, max_num_batched_tokens=max(lengths))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for n in lengths:
        ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        llm.generate(ids, one)  # warm-up
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            llm.generate(ids, one)
            best = min(best, time.perf_counter() - t0)
        rows.append({"prefill_tokens": n, "tok_s": n / best})
    return rows


def run_worker(src: Path, args: argparse.Namespace, batch: int) -> dict:
    """``measure`` in a fresh process importing deepinfer from ``src``."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--worker", "--batches", str(batch), "--context",
           str(args.context), "--steps", str(args.steps), "--threads", str(args.threads),
           "--device", args.device, "--backends", *args.backends, "--quantization", args.quantization]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", type=Path, default=None, help="another checkout (its repo root)")
    p.add_argument("--device", default="auto")
    p.add_argument("--backends", nargs="+", default=["auto"], help="decode attention backends to compare")
    p.add_argument("--quantization", default="none")
    p.add_argument("--prefill", type=int, nargs="*", default=[], help="also prefill these lengths")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, default=Path("results/decode"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.batches[0], args.context, args.steps, args.threads, False,
                                 args.device, tuple(args.backends), args.quantization)))
        return
    if args.profile:
        for b in args.batches:
            r = measure(b, args.context, args.steps, args.threads, True, args.device, tuple(args.backends[:1]),
                        args.quantization)
            print(f"batch {b}, context {args.context}, {args.backends[0]} attention: "
                  f"{r['step_s'][args.backends[0]] * 1000:.1f} ms per step, "
                  f"matmul {r['matmul_share']:.0%} of CPU time\n{r['profile']}")
        return
    here = Path(__file__).resolve().parent.parent
    checkouts = {"this": here} | ({"compare": args.compare.resolve()} if args.compare else {})
    def side(name: str, backend: str) -> str:
        return name if len(args.backends) == 1 else f"{name}_{backend}"

    rows = []
    for b in args.batches:
        best: dict[str, float] = {}
        best_cpu: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, src in checkouts.items():
                r = run_worker(src, args, b)
                for backend in args.backends:
                    key = side(name, backend)
                    best[key] = min(best.get(key, float("inf")), r["step_s"][backend])
                    best_cpu[key] = min(best_cpu.get(key, float("inf")), r["cpu_s"][backend])
        row = {"batch": b, "context": args.context} | {f"{n}_tok_s": b / s for n, s in best.items()}
        first = next(iter(best))
        if len(best) > 1:
            row["ratio"] = {n: best[first] / s for n, s in best.items()}
            row["cpu_ratio"] = {n: best_cpu[first] / s for n, s in best_cpu.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"cpu": cpu_model(), "device": args.device, "threads": args.threads,
               "quantization": args.quantization, "backends": args.backends,
               "rounds": args.rounds, "rows": rows}
    if args.prefill:
        summary["prefill"] = prefill_rates(args.prefill, args.device, args.rounds)
        for row in summary["prefill"]:
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"CPU: {summary['cpu']}, {args.threads} thread(s), quantization {args.quantization}; "
          f"tokens/s per side, best of "
          f"{args.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
