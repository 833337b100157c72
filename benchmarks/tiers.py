"""Hierarchical KV cache benchmark (issue #6), one run, ratios to compare (the machine is shared).

* bytes per token of each KV codec, and its accuracy cost: teacher-forced argmax agreement and
  perplexity change over 4 lossless 256-token generations (``deepinfer.bench.accuracy``);
* TTFT of a ~4K-token prompt whose first ~96% is cached: cold vs hit in L1 vs L2 vs L3 (a fresh
  process, the files dropped from the OS page cache first), per codec (lossless, fp8, fp4);
* L3 read throughput (DiskStore reads, and whole loads with decoding) vs ``dd`` reading the
  same number of bytes from one file on the same disk (page cache dropped for both);
* a multi-turn agent workload whose history outgrows L1: hit rate and total time with L1 only,
  L1+L2, L1+L2+L3.

Writes results/tiers/summary.json and summary.md.

    python benchmarks/tiers.py [--model PATH] [--prompt-tokens 4096] [--quick]
    python benchmarks/tiers.py generations --out tests/data/smollm2_greedy256.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "smollm2_greedy256.json"
PROMPTS = [
    "Explain how a hash table works and when you would use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What were the main causes of the French Revolution? Answer in detail.",
    "Give me a step-by-step recipe for baking sourdough bread at home.",
]
CODECS = ["lossless", "fp8", "fp4"]


def llm(model, **kw):
    from deepinfer.llm import LLM

    args = dict(progress=False, enable_disk_cache=False, host_cache_gb=0)
    args.update(kw)
    return LLM(model, **args)


def one_token():
    from deepinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def random_ids(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def ttft(engine_llm, prompt) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = engine_llm.generate(prompt, one_token())[0]
    return time.perf_counter() - t0, dict(out.cached_tokens_by_tier)


def drop_page_cache(paths) -> None:
    """Evict files from the OS page cache (so a read really reads the disk); per file, harmless."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            pass


# ---------------------------------------------------------------------------------- generations
def cmd_generations(args) -> None:
    from deepinfer.chat import render_chat
    from deepinfer.loader import load_checkpoint
    from deepinfer.sampling_params import SamplingParams

    m = llm(args.model, num_pages=512)
    ids = [m.engine.tokenize(render_chat(m.tokenizer, [{"role": "user", "content": p}])) for p in PROMPTS]
    outs = m.generate(ids, SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))
    Path(args.out).write_text(json.dumps({
        "model": m.engine.model_name, "fingerprint": load_checkpoint(args.model, progress=False).fingerprint,
        "prompts": PROMPTS, "prompt_token_ids": ids, "generated_token_ids": [o.token_ids for o in outs],
        "note": "greedy, lossless KV, ignore_eos; made by benchmarks/tiers.py generations"}))


# ---------------------------------------------------------------------------------- sections
def bytes_per_token(model) -> dict:
    from deepinfer.kv.tiers.codecs import get_codec
    from deepinfer.kv.tiers.page_bytes import PoolTransfer, page_nbytes

    m = llm(model, num_pages=4)
    t = PoolTransfer(m.engine.runner.pool)
    ps = m.engine.config.page_size
    out = {}
    for dtype in (t.dtype, torch.bfloat16):
        for name in ("lossless", "fp8", "fp8c", "fp4", "mxfp4"):
            key = name if name != "lossless" else f"lossless-{str(dtype).split('.')[-1]}"
            out[key] = page_nbytes(get_codec(name, page_size=ps), t.shapes, dtype) / ps
    return out


def accuracy(model, codecs) -> dict:
    from deepinfer.bench.accuracy import compare, tier_scored_logits

    data = json.loads(DATA.read_text())
    seqs = [p + g for p, g in zip(data["prompt_token_ids"], data["generated_token_ids"])]
    start = min(len(p) for p in data["prompt_token_ids"]) - 1
    res = {}
    for codec in codecs:
        m = llm(model, num_pages=160, max_num_batched_tokens=2048, host_cache_gb=0.25, kv_codec_host=codec)
        ref, tier = tier_scored_logits(m.engine, seqs, start)
        res[codec] = compare(ref, tier, seqs, start)
        m.engine.shutdown()
        print(f"accuracy {codec}: {res[codec]}", flush=True)
    return res


_L3_CHILD = """
import json, sys, time
sys.path.insert(0, {repo!r})
from benchmarks.tiers import llm, random_ids, ttft
model, disk, codec, prompt = sys.argv[1] or None, sys.argv[2], sys.argv[3], json.loads(open(sys.argv[4]).read())
m = llm(model, enable_disk_cache=True, disk_cache_dir=disk, kv_codec_disk=codec, num_pages={num_pages},
        max_num_batched_tokens={chunk})
ttft(m, random_ids(64, m.engine.hf_config.vocab_size, seed=98))  # warm-up (its pages: other files)
t, by_tier = ttft(m, prompt)
m.engine.shutdown()
s = m.engine.stats()
print(json.dumps({{"ttft": t, "by_tier": by_tier, "load_seconds": s["cache_load_seconds_total"],
                   "disk_bytes_read": s["cache_bytes_read_by_tier"]["disk"]}}))
"""


def ttft_section(model, n_tokens, codecs, workdir: Path) -> dict:
    """Cold vs L1 vs L2 vs L3 (fresh process) TTFT for a prompt whose first 96% is cached.
    Each codec's engine measures its own cold TTFT (empty cache) while filling the cache."""
    probe = llm(model, num_pages=4)
    vocab, ps = probe.engine.hf_config.vocab_size, probe.engine.config.page_size
    del probe
    base = random_ids(int(n_tokens * 0.96) // ps * ps, vocab, seed=1)
    tails = [random_ids(n_tokens - len(base), vocab, seed=10 + i) for i in range(4)]
    num_pages = n_tokens // ps * 3 + 64
    chunk = 2048
    res: dict = {"prompt_tokens": n_tokens, "cached_tokens": len(base)}
    for codec in codecs:
        disk = workdir / f"l3-{codec}"
        m = llm(model, num_pages=num_pages, max_num_batched_tokens=chunk, host_cache_gb=2.0,
                kv_codec_host=codec, kv_codec_disk=codec, enable_disk_cache=True, disk_cache_dir=str(disk))
        ttft(m, random_ids(64, vocab, seed=99))  # warm-up
        row = {}
        row["cold"], by = ttft(m, base + tails[3])  # nothing cached yet; fills L1 (and L3)
        assert sum(by.values()) == 0, by
        row["l1"], by = ttft(m, base + tails[0])
        assert by["device"] >= len(base) - ps, by
        m.engine.kv.evict()  # L1 -> L2
        m.engine.tiers.flush()  # a hit *in* L2: the demotion's encode is done (as it would be later)
        row["l2"], by = ttft(m, base + tails[1])
        assert by["host"] >= len(base) - ps, by
        assert m.engine.shutdown()
        files = [str(p) for p in disk.glob("??/*.kv")]
        drop_page_cache(files)
        pfile = workdir / "prompt.json"
        pfile.write_text(json.dumps(base + tails[2]))
        child = _L3_CHILD.format(repo=str(REPO), num_pages=num_pages, chunk=chunk)
        out = subprocess.run([sys.executable, "-c", child, model or "", str(disk), codec, str(pfile)],
                             capture_output=True, text=True, check=True)
        r3 = json.loads(out.stdout.strip().splitlines()[-1])
        assert r3["by_tier"]["disk"] >= len(base) - ps, r3
        row["l3"] = r3["ttft"]
        row["l3_load_seconds"] = r3["load_seconds"]
        row["l3_bytes"] = r3["disk_bytes_read"]
        row.update({f"speedup_{k}": row["cold"] / row[k] for k in ("l1", "l2", "l3")})
        res[codec] = row
        print(f"ttft {codec}: {row}", flush=True)
    res["cold"] = min(res[c]["cold"] for c in codecs)
    return res


def l3_throughput(model, workdir: Path) -> dict:
    """DiskStore read and whole-load throughput vs dd of the same bytes, page cache dropped."""
    from deepinfer.kv.tiers.disk_store import DiskStore
    from deepinfer.kv.tiers.backend import LoadJob

    disk = workdir / "l3-lossless"
    files = sorted(disk.glob("??/*.kv"))
    keys = [f.name[:-3] for f in files]
    total = sum(f.stat().st_size for f in files)
    store = DiskStore(disk, 1 << 40, None)
    drop_page_cache(map(str, files))
    t0 = time.perf_counter()
    payload = sum(len(store.get(k) or b"") for k in keys)
    t_get = time.perf_counter() - t0
    # whole loads (read + checksum + decode into L1 pages) through the engine's backend
    m = llm(model, num_pages=len(keys) + 8, enable_disk_cache=True, disk_cache_dir=str(disk))
    drop_page_cache(map(str, files))
    job = LoadJob(sources=[], probe=keys, dest=m.engine.kv.allocator.alloc(len(keys)))
    t0 = time.perf_counter()
    m.engine.tiers.start_load(job)
    while not job.done:
        m.engine.tiers.wait(0.01)
    t_load = time.perf_counter() - t0
    assert job.num_loaded == len(keys), job.num_loaded
    m.engine.shutdown()
    big = disk / "dd-probe.bin"
    with open(big, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(total // len(chunk) + 1):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache([str(big)])
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    t_dd = time.perf_counter() - t0
    big.unlink()
    mb = 2**20
    return {"files": len(files), "bytes": total, "payload_bytes": payload,
            "diskstore_get_MBps": total / t_get / mb, "tier_load_MBps": total / t_load / mb,
            "dd_MBps": (total // len(chunk) + 1) * len(chunk) / t_dd / mb,
            "get_vs_dd": (total / t_get) / ((total // len(chunk) + 1) * len(chunk) / t_dd),
            "load_vs_dd": (total / t_load) / ((total // len(chunk) + 1) * len(chunk) / t_dd)}


def agent_workload(model, workdir: Path, agents: int, turns: int, step_tokens: int,
                   bytes_per_token: float) -> dict:
    """Agents whose growing histories (tool outputs appended every turn) outgrow L1."""
    from deepinfer.sampling_params import SamplingParams

    probe = llm(model, num_pages=4)
    vocab, ps = probe.engine.hf_config.vocab_size, probe.engine.config.page_size
    del probe
    reply = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    final = 200 + turns * (step_tokens + 8)
    l1_pages = int(1.5 * final / ps) + 8  # one agent's full history and a half: not all of them
    all_gb = agents * final * bytes_per_token / 2**30  # every history, at the end
    setups = {  # each tier added with the others' sizes fixed; L2 holds ~30% of the histories
        "L1": dict(),
        "L1+L2": dict(host_cache_gb=0.3 * all_gb),
        "L1+L2+L3": dict(host_cache_gb=0.3 * all_gb, enable_disk_cache=True,
                         disk_cache_dir=str(workdir / "l3-agents"), cache_policy="write_back"),
    }
    res = {"agents": agents, "turns": turns, "tokens_per_turn": step_tokens, "l1_tokens": (l1_pages - 1) * ps}
    for name, kw in setups.items():
        m = llm(model, num_pages=l1_pages, max_num_batched_tokens=2048, max_num_seqs=agents, **kw)
        hist = [random_ids(200, vocab, seed=100 + a) for a in range(agents)]
        prompt_tokens = hit = 0
        by_tier = {"device": 0, "host": 0, "disk": 0}
        t0 = time.perf_counter()
        for t in range(turns):
            for a in range(agents):  # round robin: each agent's history is evicted between turns
                hist[a] = hist[a] + random_ids(step_tokens, vocab, seed=1000 * a + t)
                out = m.generate(hist[a], reply)[0]
                hist[a] = hist[a] + out.token_ids
                prompt_tokens += out.num_prompt_tokens
                hit += out.num_cached_tokens
                for k, v in out.cached_tokens_by_tier.items():
                    by_tier[k] += v
        seconds = time.perf_counter() - t0
        m.engine.shutdown()
        res[name] = {"seconds": seconds, "hit_rate": hit / prompt_tokens, "prompt_tokens": prompt_tokens,
                     "hit_tokens_by_tier": by_tier}
        print(f"agents {name}: {res[name]}", flush=True)
    for name in setups:
        res[name]["speedup_vs_L1"] = res["L1"]["seconds"] / res[name]["seconds"]
    return res


# ---------------------------------------------------------------------------------- report
def markdown(res: dict) -> str:
    lines = ["# KV cache tiers (benchmarks/tiers.py)", "", f"Model: {res['model']}; one run on a shared "
             f"machine ({res['device']}); compare ratios.", ""]
    bpt, acc = res["bytes_per_token"], res.get("accuracy", {})
    lines += ["## Codecs", "", "| codec | KV bytes/token | vs lossless | argmax agreement | perplexity change |",
              "|---|---:|---:|---:|---:|"]
    ll = next(v for k, v in bpt.items() if k.startswith("lossless"))
    for k, v in bpt.items():
        name = "lossless" if k.startswith("lossless") else k
        a = acc.get(name, {}) if not k.endswith("bfloat16") else {}
        agree = f"{a['argmax_agreement']:.2%}" if a else ""
        ppl = f"{a['ppl_change']:+.2%}" if a else ""
        lines.append(f"| {k} | {v:,.0f} | {v / ll:.3f} | {agree} | {ppl} |")
    t = res.get("ttft")
    if t:
        lines += ["", f"## TTFT, {t['prompt_tokens']}-token prompt, first {t['cached_tokens']} cached",
                  "", "| codec | cold | L1 hit | L2 hit | L3 hit (fresh process) | cold/L1 | cold/L2 | cold/L3 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in CODECS:
            if c in t:
                r = t[c]
                lines.append(f"| {c} | {r['cold']:.2f} s | {r['l1']:.2f} s | {r['l2']:.2f} s | {r['l3']:.2f} s | "
                             f"{r['speedup_l1']:.1f}x | {r['speedup_l2']:.1f}x | {r['speedup_l3']:.1f}x |")
    th = res.get("l3_throughput")
    if th:
        lines += ["", "## L3 read throughput (page cache dropped)", "",
                  f"{th['files']} files, {th['bytes'] / 2**20:.0f} MiB: DiskStore reads "
                  f"{th['diskstore_get_MBps']:.0f} MiB/s, whole loads (read, checksum, decode) "
                  f"{th['tier_load_MBps']:.0f} MiB/s, dd {th['dd_MBps']:.0f} MiB/s: "
                  f"{th['get_vs_dd']:.2f}x and {th['load_vs_dd']:.2f}x of dd."]
    ag = res.get("agents")
    if ag:
        lines += ["", f"## Agents: {ag['agents']} agents x {ag['turns']} turns, +{ag['tokens_per_turn']} "
                  f"tokens per turn, L1 holds {ag['l1_tokens']} tokens, L2 ~30% of the final histories", "",
                  "| tiers | hit rate | total time | speedup vs L1 only | hits device/host/disk |",
                  "|---|---:|---:|---:|---|"]
        for name in ("L1", "L1+L2", "L1+L2+L3"):
            r = ag[name]
            b = r["hit_tokens_by_tier"]
            lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['seconds']:.1f} s | {r['speedup_vs_L1']:.2f}x | "
                         f"{b['device']}/{b['host']}/{b['disk']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="run", choices=["run", "generations"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="smaller prompt and workload, fp8 accuracy only")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: accuracy,ttft,throughput,agents")
    args = ap.parse_args()
    if args.command == "generations":
        args.out = args.out or str(DATA)
        return cmd_generations(args)
    out = Path(args.out or REPO / "results" / "tiers")
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    n = 1024 if args.quick else args.prompt_tokens
    res: dict = {"model": args.model or "SmolLM2-135M-Instruct (embedded)",
                 "device": "cuda" if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads"}
    res["bytes_per_token"] = bytes_per_token(args.model)
    print("bytes/token", res["bytes_per_token"], flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-tiers-") as tmp:
        work = Path(tmp)
        if "accuracy" not in skip and args.model is None:
            res["accuracy"] = accuracy(args.model, ["fp8"] if args.quick else ["fp8", "fp8c", "fp4", "mxfp4"])
        if "ttft" not in skip:
            res["ttft"] = ttft_section(args.model, n, CODECS, work)
            if "throughput" not in skip:
                res["l3_throughput"] = l3_throughput(args.model, work)
                print("l3 throughput", res["l3_throughput"], flush=True)
        if "agents" not in skip:
            lossless = next(v for k, v in res["bytes_per_token"].items() if k.startswith("lossless"))
            res["agents"] = agent_workload(args.model, work, agents=3, turns=3 if args.quick else 5,
                                           step_tokens=96 if args.quick else 160, bytes_per_token=lossless)
        (out / "summary.json").write_text(json.dumps(res, indent=2))
        (out / "summary.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
