"""Prefill/decode disaggregation vs co-located serving (issue 15): decode time per output
token of streaming chats while long prefills keep arriving, one run, side by side.

Three set-ups in turn, each a fresh set of ``deepinfer serve`` processes (``--threads 1``
each) on the embedded SmolLM2 (or ``--model``), on loopback:

* ``decode_only``: one ``both`` server, the streaming chats alone (the baseline);
* ``colocated``: the same server, the chats while long prompts (``--prefill-tokens``, random
  token ids: no cache hits) arrive one after another;
* ``pd``: a prefill worker (``--role prefill --decode-worker``) and a decode worker
  (``--role decode``) over a ``redis-server`` store; every request goes to the prefill
  worker, which forwards it (the store route: the prompt's pages go through the store);
* ``pd_direct``: the same with ``--pd-transfer direct`` on both workers: the decode worker
  reads the pages from the prefill worker's memory over Mooncake's transfer engine (TCP).

A chat asks for ``--chat-tokens`` tokens with logprobs, so each streamed chunk says how many
tokens it holds: a chunk of k tokens arriving g seconds after the previous one counts k
gaps of g / k. Printed: p50 / p99 of those gaps and their ratio to ``decode_only``, with the
CPU model. The lower tiers are off (``--no-disk-cache --host-cache-gb 0``; under PD the store
is L3), so the set-ups differ only in where prompts are computed.

Then, for each PD set-up, the hand-over alone: ``--handovers`` long prompts of the first
length, one at a time on idle workers; per request the prefill worker's publish time (store
route: its pages written and acknowledged), the decode worker's pull time (direct route) and its
load time (pages from the store or the pulled buffer into its device pool: ``kv_load_seconds``),
as means.

    python benchmarks/pd.py [--model PATH] [--chats 3] [--prefills 4]
        [--prefill-tokens 2048,3072,4096] [--chat-tokens 96] [--handovers 4] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deepinfer.hardware import lscpu_model

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def serve(args, port: int, log: Path, *extra: str) -> subprocess.Popen:
    model = ["--model", args.model] if args.model else []
    return start([sys.executable, "-m", "deepinfer.cli", "serve", *model, "--port", str(port),
                  "--threads", "1", "--no-disk-cache", "--host-cache-gb", "0",
                  "--max-model-len", str(max(args.prefill_tokens) + 256),
                  "--log-level", "warning", *extra], log)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not start")


async def chat_loop(client: httpx.AsyncClient, url: str, k: int, tokens: int, stop: asyncio.Event,
                    min_requests: int, gaps: list[float]) -> None:
    """Streaming chats one after another until ``stop`` (and at least ``min_requests``)."""
    n = 0
    while n < min_requests or not stop.is_set():
        body = {"messages": [{"role": "user", "content": f"Chat {k}.{n}: tell me about caches."}],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "logprobs": True}
        last = None
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                got = sum(len((c.get("logprobs") or {}).get("content") or [])
                          for c in chunk["choices"])
                if not got:
                    continue
                now = time.perf_counter()
                if last is not None:  # the first token's wait is TTFT, not decode time
                    gaps += [(now - last) / got] * got
                last = now
        n += 1


async def prefill_loop(client: httpx.AsyncClient, url: str, sizes: list[int], vocab: int,
                       seconds: list[float]) -> None:
    """Long prompts (random ids: never cached) one after another."""
    rng = random.Random(0)
    for n in sizes:
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json={
            "prompt": [rng.randrange(100, vocab) for _ in range(n)], "max_tokens": 2,
            "temperature": 0})
        r.raise_for_status()
        seconds.append(time.perf_counter() - t0)


def load_seconds(url: str) -> float:
    """The decode worker's summed KV load time so far (``kv_load_seconds`` histogram)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("deepinfer:kv_load_seconds_sum"))


def handovers(args, url: str, decode_url: str) -> dict:
    """Long prompts alone, one at a time: mean publish, pull and load seconds per request."""
    rng = random.Random(1)
    publish, pull, load = [], [], []
    for _ in range(args.handovers):
        before = load_seconds(decode_url)
        r = httpx.post(url + "/v1/completions", timeout=None, json={
            "prompt": [rng.randrange(100, args.vocab) for _ in range(args.prefill_tokens[0])],
            "max_tokens": 2, "temperature": 0})
        r.raise_for_status()
        pre = r.json()["usage"]["prefill_worker"]
        publish.append(pre["publish_s"])
        pull.append(pre.get("pull_s", 0.0))
        load.append(load_seconds(decode_url) - before)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"publish_s": mean(publish), "pull_s": mean(pull), "load_s": mean(load)}


async def workload(args, url: str, with_prefills: bool) -> dict:
    gaps: list[float] = []
    seconds: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=None) as client:
        chats = [asyncio.create_task(chat_loop(client, url, k, args.chat_tokens, stop,
                                               1 if with_prefills else args.baseline_requests,
                                               gaps)) for k in range(args.chats)]
        if with_prefills:
            await asyncio.sleep(1.0)  # decoding is under way when the first long prompt lands
            sizes = [args.prefill_tokens[i % len(args.prefill_tokens)]
                     for i in range(args.prefills)]
            await prefill_loop(client, url, sizes, args.vocab, seconds)
        stop.set()
        await asyncio.gather(*chats)
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(p * len(gaps)))] if gaps else float("nan")  # noqa: E731
    return {"tokens": len(gaps), "p50_s": q(0.50), "p99_s": q(0.99),
            "prefill_s": sum(seconds) / len(seconds) if seconds else None}


def run_setup(args, name: str, tmp: Path) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        if name.startswith("pd"):
            rport, dport, pport = free_port(), free_port(), free_port()
            procs.append(start([shutil.which("redis-server") or "redis-server", "--port",
                                str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--maxmemory", args.redis_memory,
                                "--maxmemory-policy", "allkeys-lru"], tmp / "redis.log"))
            store = ["--kv-store", f"redis://127.0.0.1:{rport}",
                     "--pd-transfer", "direct" if name == "pd_direct" else "store"]
            dlog, plog = tmp / "decode.log", tmp / "prefill.log"
            procs.append(serve(args, dport, dlog, "--role", "decode", *store))
            procs.append(serve(args, pport, plog, "--role", "prefill", "--decode-worker",
                               f"http://127.0.0.1:{dport}", *store))
            wait_ready(f"http://127.0.0.1:{dport}", procs[1], dlog)
            url = f"http://127.0.0.1:{pport}"
            wait_ready(url, procs[2], plog)
            out = asyncio.run(workload(args, url, with_prefills=True))
            return {**out, **handovers(args, url, f"http://127.0.0.1:{dport}")}
        else:
            port = free_port()
            log = tmp / f"{name}.log"
            procs.append(serve(args, port, log))
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, procs[0], log)
        return asyncio.run(workload(args, url, with_prefills=name != "decode_only"))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--chats", type=int, default=3, help="concurrent streaming chats")
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--prefills", type=int, default=4, help="long prompts, one after another")
    ap.add_argument("--prefill-tokens", default="2048,3072,4096",
                    help="their lengths, cycled")
    ap.add_argument("--handovers", type=int, default=4,
                    help="PD set-ups: long prompts timed alone afterwards (hand-over cost)")
    ap.add_argument("--baseline-requests", type=int, default=2,
                    help="decode_only: chat requests per chat")
    ap.add_argument("--vocab", type=int, default=49152, help="random prompt ids below this")
    ap.add_argument("--redis-memory", default="3gb", help="the store's maxmemory")
    ap.add_argument("--quick", action="store_true",
                    help="2 chats of 48 tokens, 2 prefills of 2048 (a sanity run)")
    args = ap.parse_args()
    args.prefill_tokens = [int(x) for x in args.prefill_tokens.split(",")]
    if args.quick:
        args.chats, args.chat_tokens, args.prefills, args.prefill_tokens = 2, 48, 2, [2048]
        args.handovers = 2
    if shutil.which("redis-server") is None:
        print("redis-server is needed for the pd set-up (scripts/setup.sh installs it)")
        return 1
    results = {}
    with tempfile.TemporaryDirectory(prefix="deepinfer-pd-bench-") as tmp:
        for name in ("decode_only", "colocated", "pd", "pd_direct"):
            results[name] = run_setup(args, name, Path(tmp))
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    base = results["decode_only"]
    print(f"CPU: {lscpu_model()}; {args.chats} streaming chats of {args.chat_tokens} tokens; "
          f"{args.prefills} long prompts of {args.prefill_tokens} tokens; --threads 1 per server")
    print("| set-up | decode tokens | p50 ms/token | p99 ms/token | p50 vs decode-only "
          "| p99 vs decode-only | long prompt s (mean) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        pre = f"{r['prefill_s']:.1f}" if r["prefill_s"] is not None else "-"
        print(f"| {name} | {r['tokens']} | {1e3 * r['p50_s']:.1f} | {1e3 * r['p99_s']:.1f} | "
              f"{r['p50_s'] / base['p50_s']:.2f}x | {r['p99_s'] / base['p99_s']:.2f}x | {pre} |")
    print(f"\nHand-over of one {args.prefill_tokens[0]}-token prompt on idle workers "
          f"(mean of {args.handovers}): ms")
    print("| route | prefill: publish (store) or export (direct) | decode: pull | decode: load into the pool | "
          "pull + load vs store load |")
    print("|---|---|---|---|---|")
    store_load = results["pd"]["load_s"]
    for name in ("pd", "pd_direct"):
        r = results[name]
        print(f"| {'store' if name == 'pd' else 'direct'} | {1e3 * r['publish_s']:.1f} | "
              f"{1e3 * r['pull_s']:.1f} | {1e3 * r['load_s']:.1f} | "
              f"{(r['pull_s'] + r['load_s']) / store_load:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
