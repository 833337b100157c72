"""TTFT of a mostly cached long prompt, from each tier, next to cold prefill and the read bound
(issue 17), one run, side by side.

For each codec, prompt size and hit rate: a prompt whose first ``hit`` share (whole pages) is
cached answers its first token from L1, from L2, from L3 with its files in the OS page cache,
and from L3 cold (the files dropped from the page cache with ``posix_fadvise(DONTNEED)``), the
L3 cases in a fresh process each, warmed up as a running server is: the same hit with another
tail first (its L3 load and its tail's forward over the whole context: the first such forward
of a process cost up to 3x the CPU of the next on a loaded 2-core machine, README #17), then
L1 emptied and, for the cold case, the files dropped (``--warm-up shapes``: only a prompt of the
tail's length that shares nothing, a just-started server); next to (a) the cold prefill of the same prompt and (b) the
bound: a plain sequential read of the same files (page-cached, and cold) plus the prefill of
the uncached tail (the L1 TTFT stands for it); the read also into distinct memory touched
beforehand (what a load does: its L1 pool is zeroed at start), the fairer bound for the load
alone. Both L3 cases also run with layer-wise loads
(``--kv-stream-layers``), alternating with the whole-page ones. Every TTFT uses a fresh tail, so
no case hits another's tail pages. With the default model, llama.cpp's in-context and RAM-cache
hits of the same prompts too (``llamacpp_cache.py``; ``--llamacpp-python ''`` skips them).

``--promotion`` adds idle-time promotion (``--kv-idle-promote-mb``) on a multi-turn workload:
conversations whose turns are separated by one-off requests that push them out of a small L2,
then an idle period (the server's ``on_idle`` loop, run here between requests) before each next
turn; TTFT p50 of the later turns with promotion off and on, with the L3 files page-cached and
dropped from the page cache after each request (``promotion.py``). ``--quick`` is the 8K
prompt at 96% and 99%, lossless, plus the promotion comparison (about 5 minutes on 2 cores).

    python benchmarks/ttft_cache.py [--model PATH] [--sizes 2000,4000,8000] [--hits 0.96,0.99]
        [--codecs lossless,fp8,fp4] [--promotion] [--quick] [--out results/ttft_cache]

Writes ``summary.json`` and ``summary.md`` under ``--out``; prints the CPU model with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_cache  # noqa: E402
from tiers import drop_page_cache, llm, one_token, random_ids  # noqa: E402

from deepinfer.hardware import lscpu_model  # noqa: E402
from deepinfer.loader import default_model_path  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from deepinfer.threads import available_cores  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHUNK = 2048

_CHILD = """
import json, resource, sys
sys.path.insert(0, {repo!r})
sys.path.insert(0, {bench!r})
from tiers import drop_page_cache
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
model, disk, codec, pfile, stream = sys.argv[1:6]
case = json.load(open(pfile))
m = LLM(model or None, progress=False, num_pages={num_pages}, max_num_batched_tokens={chunk},
        host_cache_gb=0, kv_codec_disk=codec, enable_disk_cache=True, disk_cache_dir=disk,
        kv_stream_layers=stream == "1")
one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
# warm-up as a running server is: the same hit with another tail (an L3 load and the tail's
# forward over the whole context), then L1 emptied, so the timed prompt loads from L3 again
m.generate(case["warm"], one)
m.engine.kv.evict()
m.engine.tiers.flush()  # the warm-up's write-through (its tail's pages) would run beside the hit
if case["cold"]:
    drop_page_cache(case["files"])
flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = m.generate(case["prompt"], one)[0]
flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt  # pool first touched? (no: zeroed)
print(json.dumps({{"ttft": out.ttft, "by_tier": out.cached_tokens_by_tier, "minflt": flt,
                  "load_seconds": out.load_seconds, "load_bytes": out.load_bytes_by_tier,
                  "load_gb_per_s": out.load_gb_per_s}}))
"""


def ttft(m, prompt) -> tuple[float, dict]:
    out = m.generate(prompt, one_token())[0]
    return out.ttft, dict(out.cached_tokens_by_tier)


def read_all(paths: list[str]) -> float:
    """Seconds to read ``paths`` in order with a plain loop (the raw-read bound)."""
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 22):
                pass
    return time.perf_counter() - t0


def read_all_distinct(paths: list[str]) -> float:
    """Seconds to read ``paths`` into distinct memory touched beforehand, as a load lands its
    pages in the (touched) L1 pool: the fairer bound where the files are page-cached."""
    sizes = [os.path.getsize(p) for p in paths]
    flat = bytearray(b"\1") * sum(sizes)
    view, at = memoryview(flat), 0
    t0 = time.perf_counter()
    for p, n in zip(paths, sizes):
        with open(p, "rb", buffering=0) as f:
            f.readinto(view[at : at + n])
        at += n
    return time.perf_counter() - t0


def l3_child(model, disk: Path, codec: str, prompt: list[int], warm: list[int], files: list[str],
             cold: bool, num_pages: int, work: Path, stream: bool) -> dict:
    """The timed hit in a fresh process, after a warm-up hit on the same prefix (``_CHILD``)."""
    pfile = work / "case.json"
    pfile.write_text(json.dumps({"prompt": prompt, "warm": warm, "files": files, "cold": cold}))
    child = _CHILD.format(repo=str(REPO), bench=str(REPO / "benchmarks"), num_pages=num_pages,
                          chunk=CHUNK)
    out = subprocess.run([sys.executable, "-c", child, model or "", str(disk), codec, str(pfile),
                          "1" if stream else "0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_case(model, codec: str, n: int, hit: float, work: Path, warm_hit: bool = True,
             peer: Path | None = None) -> dict:
    m = llm(model, num_pages=4)
    vocab, ps = m.engine.hf_config.vocab_size, m.engine.config.page_size
    del m
    base = random_ids(int(n * hit) // ps * ps, vocab, seed=n)
    tails = [random_ids(n - len(base), vocab, seed=100 + i) for i in range(11)]
    peer_row = {}
    if peer is not None:  # before our engine starts: each side runs alone
        peer_row["llamacpp"] = llamacpp_cache.cache_ttfts(peer, default_model_path(), base, tails,
                                                          random_ids(64, vocab, seed=99), available_cores())
    disk = work / f"l3-{codec}-{n}-{hit}"
    num_pages = n // ps * 4 + 64
    m = llm(model, num_pages=num_pages, max_num_batched_tokens=CHUNK, host_cache_gb=4.0,
            kv_codec_host=codec, kv_codec_disk=codec, enable_disk_cache=True,
            disk_cache_dir=str(disk))
    ttft(m, random_ids(len(tails[0]), vocab, seed=7))  # warm-up: the tail's shapes
    row: dict = {"codec": codec, "prompt_tokens": n, "cached_tokens": len(base), **peer_row}
    row["cold"], by = ttft(m, base + tails[0])  # nothing cached: fills L1 and L3
    assert sum(by.values()) == 0, by
    m.engine.tiers.flush()  # the cold prompt's write-through to L2/L3 would run beside the L1 hit
    row["l1"], by = ttft(m, base + tails[1])
    assert by["device"] == len(base), by
    m.engine.kv.evict()  # L1 -> L2
    m.engine.tiers.flush()
    row["l2"], by = ttft(m, base + tails[2])
    assert by["host"] == len(base), by
    eng = m.engine
    from deepinfer.kv.hashing import chain_hashes

    keys = [eng.tiers.disk_key(h) for h in chain_hashes(base, ps, eng.kv.root(None))]
    files = [str(disk / k[:2] / f"{k}.kv") for k in keys]
    assert eng.shutdown()
    row["bytes"] = sum(os.path.getsize(f) for f in files)
    read_all(files)
    row["raw_read_cached"] = read_all(files)
    drop_page_cache(files)
    row["raw_read_cold"] = read_all(files)
    drop_page_cache(files)
    row["raw_read_cold_distinct"] = read_all_distinct(files)
    row["raw_read_cached_distinct"] = read_all_distinct(files)
    read_all(files)  # back in the page cache
    cases = (("l3_cached", 3, False), ("l3_cached_layers", 5, True),
             ("l3_cold", 4, False), ("l3_cold_layers", 6, True))
    for case, t, stream in cases:  # whole-page and layer-wise loads, alternating
        read_all(files)  # (the child drops them for a cold case, after its warm-up)
        warm = (base if warm_hit else []) + tails[t + 4]
        r = l3_child(model, disk, codec, base + tails[t], warm, files,
                     "cold" in case, num_pages, work, stream)
        assert r["by_tier"]["disk"] == len(base), r
        row[case] = r["ttft"]
        row[f"{case}_load_seconds"] = r["load_seconds"]
        row[f"{case}_load_gb_per_s"] = r["load_gb_per_s"]
        row[f"{case}_minflt"] = r["minflt"]
    for state in ("cached", "cold"):
        row[f"bound_{state}"] = row[f"raw_read_{state}"] + row["l1"]
        row[f"l3_{state}_vs_bound"] = row[f"l3_{state}"] / row[f"bound_{state}"]
        row[f"load_vs_raw_{state}"] = row[f"raw_read_{state}"] / row[f"l3_{state}_load_seconds"]
        row[f"load_vs_raw_distinct_{state}"] = (row[f"raw_read_{state}_distinct"]
                                                / row[f"l3_{state}_load_seconds"])
        row[f"speedup_l3_{state}"] = row["cold"] / row[f"l3_{state}"]
        row[f"layers_vs_whole_{state}"] = row[f"l3_{state}_layers"] / row[f"l3_{state}"]
    print(json.dumps(row), flush=True)
    return row


PROMO_L2_GB = 0.125  # L2 small next to the one-off requests between turns
PROMO_MB = 64.0  # --kv-idle-promote-mb when on (the promoter also keeps to a quarter of L2)


def idle(m, disk: Path, drop: bool, limit: float = 10.0) -> float:
    """The engine's idle period between requests: writes land, the L3 files optionally leave
    the page cache (time passes), then the server's ``on_idle`` loop until nothing is in flight.
    -> seconds spent promoting."""
    m.engine.tiers.flush()
    if drop:
        drop_page_cache([str(p) for p in disk.rglob("*.kv")])
    t0 = time.perf_counter()
    while m.engine.kv.on_idle() and time.perf_counter() - t0 < limit:
        time.sleep(0.005)
    return time.perf_counter() - t0


def promotion_case(model, promote_mb: float, drop: bool, args, work: Path) -> dict:
    """One run of the multi-turn workload; TTFT of every turn after the first."""
    disk = work / f"promo-{promote_mb}-{drop}"
    m = llm(model, num_pages=args.promo_background // 16 + 32, max_num_batched_tokens=CHUNK,
            host_cache_gb=PROMO_L2_GB, enable_disk_cache=True, disk_cache_dir=str(disk),
            kv_idle_promote_mb=promote_mb)
    vocab = m.engine.hf_config.vocab_size
    reply = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    convs = [random_ids(args.promo_first, vocab, seed=300 + c) for c in range(args.promo_convs)]
    ttft(m, random_ids(64, vocab, seed=299))  # warm-up
    later, by_tier, idle_s, seed = [], {"device": 0, "host": 0, "disk": 0}, 0.0, 400
    for turn in range(args.promo_turns):
        for c in range(len(convs)):
            if turn:  # other traffic since this conversation's last turn, then an idle period
                for _ in range(2):
                    seed += 1
                    m.generate(random_ids(args.promo_background, vocab, seed=seed), reply)
                idle_s += idle(m, disk, drop)
            out = m.generate(convs[c], reply)[0]
            if turn:
                later.append(out.ttft)
                for t, k in out.cached_tokens_by_tier.items():
                    by_tier[t] += k
            seed += 1
            convs[c] = convs[c] + out.token_ids + random_ids(args.promo_step, vocab, seed=seed)
    stats = m.engine.kv.tiers.promoter.stats() if promote_mb else {}
    assert m.engine.shutdown()
    return {"promote_mb": promote_mb, "page_cache": "dropped" if drop else "cached",
            "ttft_p50": statistics.median(later), "ttft_mean": statistics.fmean(later),
            "turns": len(later), "cached_tokens_by_tier": by_tier, "idle_seconds": idle_s,
            "promoted_pages": stats.get("promoted_pages", 0)}


def promotion_rows(model, args, work: Path) -> list[dict]:
    """Off and on, alternating, in each page-cache state."""
    rows = []
    for drop in (False, True):
        for promote_mb in (0.0, PROMO_MB):
            rows.append(promotion_case(model, promote_mb, drop, args, work))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def promotion_markdown(rows: list[dict]) -> str:
    lines = [f"Idle promotion, multi-turn: {PROMO_L2_GB} GB L2, two one-off requests between a "
             "conversation's turns, then an idle period. TTFT of the later turns, seconds.", "",
             "| L3 page cache | --kv-idle-promote-mb | TTFT p50 | TTFT mean | cached tokens "
             "L1 / L2 / L3 | pages promoted | idle seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["cached_tokens_by_tier"]
        lines.append(f"| {r['page_cache']} | {r['promote_mb']:g} | {r['ttft_p50']:.3f} | "
                     f"{r['ttft_mean']:.3f} | {t['device']} / {t['host']} / {t['disk']} | "
                     f"{r['promoted_pages']} | {r['idle_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], cpu: str) -> str:
    head = ("| codec | prompt | hit | cold | L1 | L2 | L3 cached | L3 cold | bound cached | "
            "bound cold | L3 cold speed-up | L3 load / raw read (cached, cold) | "
            "L3 load / raw read into distinct memory (cached, cold) | "
            "layer-wise L3 cached, cold (x whole-page) |")
    lines = [f"CPU: {cpu}. TTFT in seconds; bound = raw read of the same files + the L1 TTFT "
             "(tail prefill); L3 cases each in a fresh process; layer-wise: "
             "`--kv-stream-layers`.", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        hit = r["cached_tokens"] / r["prompt_tokens"]
        lines.append(
            f"| {r['codec']} | {r['prompt_tokens']} | {hit:.1%} | {r['cold']:.2f} | {r['l1']:.3f} | "
            f"{r['l2']:.3f} | {r['l3_cached']:.3f} | {r['l3_cold']:.3f} | {r['bound_cached']:.3f} | "
            f"{r['bound_cold']:.3f} | {r['speedup_l3_cold']:.1f}x | "
            f"{r['load_vs_raw_cached']:.2f}x, {r['load_vs_raw_cold']:.2f}x | "
            f"{r['load_vs_raw_distinct_cached']:.2f}x, {r['load_vs_raw_distinct_cold']:.2f}x | "
            f"{r['l3_cached_layers']:.3f} ({r['layers_vs_whole_cached']:.2f}x), "
            f"{r['l3_cold_layers']:.3f} ({r['layers_vs_whole_cold']:.2f}x) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M)")
    ap.add_argument("--sizes", default="2000,4000,8000")  # the 8K prompt: 8,000 tokens + 1 fits 8192
    ap.add_argument("--hits", default="0.96,0.99")
    ap.add_argument("--codecs", default="lossless,fp8,fp4")
    ap.add_argument("--promotion", action="store_true", help="add the idle-promotion comparison")
    ap.add_argument("--promo-convs", type=int, default=2)
    ap.add_argument("--promo-turns", type=int, default=4)
    ap.add_argument("--promo-first", type=int, default=1024, help="first turn's prompt tokens")
    ap.add_argument("--promo-step", type=int, default=128, help="user tokens added per turn")
    ap.add_argument("--promo-background", type=int, default=1536, help="tokens of each one-off request")
    ap.add_argument("--quick", action="store_true", help="8K at 96%%/99%%, lossless, + promotion")
    ap.add_argument("--warm-up", choices=["hit", "shapes"], default="hit",
                    help="an L3 child's warm-up: the same hit with another tail (a running server), or "
                         "only a prompt of the tail's length sharing nothing (a just-started one)")
    ap.add_argument("--llamacpp-python", default=str(llamacpp_cache.DEFAULT_PEER),
                    help="python of a venv with llama-cpp-python: its RAM cache on the same prompts, "
                         "with the first codec and the default model ('' to skip)")
    ap.add_argument("--out", default=str(REPO / "results" / "ttft_cache"))
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.hits, args.codecs, args.promotion = "8000", "0.96,0.99", "lossless", True
        args.promo_turns = 3
    cpu = lscpu_model()
    print(f"CPU: {cpu}", flush=True)
    rows, promo = [], []
    with tempfile.TemporaryDirectory(prefix="deepinfer-ttft-") as tmp:
        peer = llamacpp_cache.peer_python(args.llamacpp_python) if args.model is None else None
        for i, codec in enumerate(filter(None, args.codecs.split(","))):
            for n in map(int, args.sizes.split(",")):
                for hit in map(float, args.hits.split(",")):
                    rows.append(one_case(args.model, codec, n, hit, Path(tmp), args.warm_up == "hit",
                                         peer if i == 0 else None))
        if args.promotion:
            promo = promotion_rows(args.model, args, Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"cpu": cpu, "rows": rows, "promotion": promo},
                                                 indent=2))
    extra = [llamacpp_cache.markdown(rows), promotion_markdown(promo) if promo else ""]
    md = markdown(rows, cpu) + "".join("\n" + part for part in extra if part)
    (out / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
