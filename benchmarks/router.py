"""Routing across workers (issue 15): hit rate, TTFT p50/p90 and total time of one workload
through ``deepinfer router`` (round_robin, kv), through ``sglang-router`` (cache_aware) in
front of the same workers, and on one engine holding all the memory, side by side in one run.
A ``/pool`` config gives its workers (the single engine too, so memory stays equal) one shared
KV pool besides: a fresh ``redis-server`` per run behind ``--kv-store``, every cached page
written through to it; which tier served the hits comes from the responses' usage.

Two ``deepinfer serve`` workers of the embedded SmolLM2 (``--threads 1`` each, ``--num-pages``
small: one worker holds about half the sessions, the single engine all of them), started fresh
for every run: no config inherits another's cache. The workloads are ``deepinfer.bench``'s
multi-turn chat and agent loop, driven by its client (streamed requests; TTFT measured at the
client, cached tokens from each response's usage). Each round runs every config on the same
prompts (new ones per round), the configs in a rotated order; ``router_report.py`` pools the
rounds and bootstraps the TTFT percentiles, so "kv beats round_robin" is decided by an interval.

    python benchmarks/router.py [--quick] [--rounds 2] [--pages 80] [--out results/router]
        [--configs round_robin,kv,kv@duplicate-weight=0/pool,kv/pool] [--workloads chat]

Writes ``summary.json`` and ``summary.md`` under ``--out``; prints the CPU model with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from deepinfer.bench.client import ClientConfig, run_workload
from deepinfer.bench.metrics import summarize
from deepinfer.bench.sessions import Workload
from deepinfer.bench.workloads import agent_loop, multi_turn_chat
from deepinfer.hardware import lscpu_model
from router_report import aggregate, markdown

CONFIGS = ("single_engine_2x", "round_robin", "kv", "sglang_cache_aware",
           "single_engine_2x/pool", "kv/pool")
# --quick leaves out sglang's cache_aware (it lost on TTFT on both workloads in every quick run
# of the seventh session) and the single engine with the pool (its 2x pool never evicts at the
# quick shapes, so the pool added nothing to it in the eighth session's runs; kv/pool is then
# compared with the single engine without it): 16 runs instead of 20
QUICK_CONFIGS = ("single_engine_2x", "round_robin", "kv", "kv/pool")
POOL = "/pool"
POOL_BYTES = "256mb"  # redis-server's maxmemory: several times a run's pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, path: str = "/health",
               timeout: float = 300) -> None:
    """Until ``path`` answers 200 (``/v1/models``: with a model listed, i.e. a worker joined)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=2)
            if r.status_code == 200 and (path != "/v1/models" or r.json().get("data")):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def start_pool(logs: Path) -> tuple[list[str], subprocess.Popen]:
    """A fresh shared KV pool: ``redis-server`` on a free port, nothing persisted; the
    ``--kv-store`` arguments of its workers."""
    port = free_port()
    proc = spawn([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                  "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory", POOL_BYTES,
                  "--maxmemory-policy", "allkeys-lru"], logs / "redis.log")
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not listen on {port}")
        time.sleep(0.05)
    # a loaded machine may take longer than the 2 s default for a store call
    return ["--kv-store", f"redis://127.0.0.1:{port}", "--kv-store-option", "timeout_s=10"], proc


def start_workers(n: int, pages: int, max_len: int, logs: Path, store: list[str],
                  procs: list[subprocess.Popen]) -> list[str]:
    """``n`` workers, their processes appended to ``procs`` (stopped by the caller)."""
    urls = []
    for i in range(n):
        port = free_port()
        procs.append(spawn([sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port),
                            "--threads", "1", "--num-pages", str(pages), "--max-model-len",
                            str(max_len), "--no-disk-cache", "--host-cache-gb", "0", *store,
                            "--log-level", "warning"], logs / f"worker{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for u, p in zip(urls, procs[-n:]):
        wait_ready(u, p)
    return urls


def start_front(config: str, workers: list[str], log: Path, procs: list[subprocess.Popen]
                ) -> str:
    """The router in front of ``workers``, its process appended to ``procs``."""
    port = free_port()
    if config == "sglang_cache_aware":
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--policy", "cache_aware", "--worker-urls", *workers,
                "--log-level", "warn"]
    else:
        policy, extra = front_args(config)
        args = [sys.executable, "-m", "deepinfer.cli", "router", "--port", str(port),
                "--policy", policy, "--log-level", "info",  # info: its placement log
                *[a for w in workers for a in ("--worker", w)], *extra]
    proc = spawn(args, log)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "/v1/models" if config == "sglang_cache_aware" else "/health")
    return url


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


@dataclass(frozen=True)
class Shape:
    """One workload's size in a mode, and the worker pool that makes routing matter for it:
    one engine with two pools holds every session, one worker about half of them."""

    sessions: int
    turns: int
    pages: int  # per worker (16 tokens each); the single engine has twice as many


# Odd session counts: with an even one, strict alternation sends every turn of a session to
# the same worker (turn t of session u is request t * n + u), which no real arrival order does.
SHAPES = {("chat", True): Shape(7, 3, 56), ("agent", True): Shape(5, 3, 72),
          ("chat", False): Shape(11, 4, 96), ("agent", False): Shape(7, 4, 112)}


def workload(name: str, shape: Shape, seed: int) -> Workload:
    """Seeded by the round: each round has new prompts, the same for every config in it."""
    if name == "chat":
        return multi_turn_chat(num_users=shape.sessions, turns=shape.turns, system_tokens=160,
                               user_tokens=48, max_tokens=16, seed=seed)
    return agent_loop(num_agents=shape.sessions, steps=shape.turns, num_tools=3,
                      task_tokens=48, tool_output_tokens=48, tool_output_growth=24,
                      max_tokens=16, tool_format="text", seed=seed)


def front_args(config: str) -> tuple[str, list[str]]:
    """``kv@evict-weight=0.5+overlap-weight=2`` -> ("kv", [--evict-weight 0.5 --overlap-weight 2])
    (``+``: ``--configs`` is split at commas; a ``/pool`` suffix is the workers', not the
    router's)."""
    policy, _, opts = config.removesuffix(POOL).partition("@")
    args = []
    for kv in filter(None, opts.split("+")):
        k, _, v = kv.partition("=")
        args += [f"--{k}", v]
    return policy, args


def placements(log: Path, workers: list[str]) -> list[dict]:
    """The router's placement log (``deepinfer.router.placement``), in order of routing:
    which worker (0, 1) got each request, its prompt tokens, predicted hit pages (its own, and
    those it loads from a shared pool), the costs."""
    out = []
    for line in log.read_text().splitlines():
        if "placement {" in line:
            p = json.loads(line[line.index("placement {") + len("placement "):])
            out.append({"worker": workers.index(p["worker"]), "prompt_tokens": p["prompt_tokens"],
                        "hit_pages": p["hit_pages"], "pooled_pages": p["pooled_pages"],
                        "sticky": p["sticky"], "awaits": p["awaits"],
                        "costs": [p["costs"].get(w) for w in workers],
                        "loads": [p["loads"].get(w) for w in workers]})
    return out


def run_one(config: str, wl: Workload, pages: int, max_len: int, concurrency: int,
            logs: Path) -> dict:
    front_name = config.removesuffix(POOL)
    single = front_name == "single_engine_2x"
    # a worker refuses a max_model_len its pool cannot hold (it keeps one page back); the same
    # limit for both, so the single engine serves the same requests
    max_len = min(max_len, (pages - 1) * 16)
    procs: list[subprocess.Popen] = []
    front_log = logs / f"{config.replace('/', '_')}.log"
    try:
        store: list[str] = []
        if config.endswith(POOL):
            store, pool = start_pool(logs)
            procs.append(pool)
        workers = start_workers(1 if single else 2, pages * 2 if single else pages, max_len,
                                logs, store, procs)
        base = workers[0]
        if not single:
            base = start_front(front_name, workers, front_log, procs)
        model = httpx.get(workers[0] + "/v1/models").json()["data"][0]["id"]
        cfg = ClientConfig(base_url=base, model=model, concurrency=concurrency,
                           request_timeout_s=600, progress=False)
        t0 = time.perf_counter()
        records = run_workload(cfg, wl)
        total = time.perf_counter() - t0
        s = summarize(records)
        placed = [] if single or front_name == "sglang_cache_aware" else placements(front_log,
                                                                                    workers)
        return {"placements": placed, "hit_rate": s["hit_rate"], "total_s": total,
                "ttft_s": [r.ttft_s for r in records if r.ok and r.ttft_s is not None],
                "ttft_by_request": {r.request_id: r.ttft_s for r in records
                                    if r.ok and r.ttft_s is not None},
                "cached_tokens_by_tier": s["cached_tokens_by_tier"],
                # which requests missed: session / turn -> (prompt, cached) tokens
                "hits_by_request": {r.request_id: (r.prompt_tokens, r.cached_tokens)
                                    for r in records if r.ok},
                # when each was sent (s into the run) and which tiers served its hits
                "sent_by_request": {r.request_id: r.arrival_s for r in records},
                "tiers_by_request": {r.request_id: r.cached_by_tier for r in records if r.ok},
                "requests": s["num_requests"], "errors": s["num_errors"],
                "first_errors": [r.error for r in records if not r.ok][:3],
                "prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"]}
    except RuntimeError as e:
        return {"failed": str(e)}
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sessions, turns and rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default: 2 quick, 3 else")
    ap.add_argument("--pages", type=int, default=None,
                    help="KV pages (16 tokens) per worker, all workloads (default: per workload)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--configs", default=None,
                    help=f"default: {','.join(CONFIGS)} (--quick: {','.join(QUICK_CONFIGS)}); "
                         "also kv@OPTION=VALUE+...: the kv router with those options, e.g. "
                         "kv@evict-weight=0+overlap-weight=2, and NAME/pool: with the shared pool")
    ap.add_argument("--workloads", default="chat,agent")
    ap.add_argument("--out", default="results/router")
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (2 if args.quick else 3)
    configs = (args.configs.split(",") if args.configs else
               list(QUICK_CONFIGS if args.quick else CONFIGS))
    names = args.workloads.split(",")
    shapes = {n: SHAPES[n, args.quick] for n in names}
    if args.pages:
        shapes = {n: replace(sh, pages=args.pages) for n, sh in shapes.items()}
    res = {"cpu": lscpu_model(), "quick": args.quick, "rounds": rounds,
           "concurrency": args.concurrency,
           "workloads": {n: {"shape": f"{sh.sessions} sessions x {sh.turns} turns",
                             "pages": sh.pages} for n, sh in shapes.items()},
           "note": f"2 workers, --threads 1 each; single engine: one worker with both pools; "
                   "/pool: its workers share a fresh redis-server KV pool (write-through); "
                   f"client concurrency {args.concurrency}; {rounds} rounds, configs "
                   "interleaved (each round starts at the next config), fresh workers per run",
           "runs": {n: {c: [] for c in configs} for n in names}}
    for r in range(rounds):
        for name in names:
            wl = workload(name, shapes[name], seed=r)
            for config in configs[r % len(configs):] + configs[:r % len(configs)]:
                print(f"round {r} / {name} / {config} ...", file=sys.stderr, flush=True)
                run = run_one(config, wl, shapes[name].pages, args.max_model_len,
                              args.concurrency, logs)
                res["runs"][name][config].append(run)
                brief = ("placements", "ttft_s", "ttft_by_request", "hits_by_request",
                         "sent_by_request", "tiers_by_request")
                print("  " + json.dumps({k: v for k, v in run.items() if k not in brief}),
                      file=sys.stderr, flush=True)
            (out / "summary.json").write_text(json.dumps(res, indent=1))
    aggs = {n: {c: aggregate(rs) for c, rs in rows.items()} for n, rows in res["runs"].items()}
    per_request = ("ttft_s", "ttft_by_request")  # in the runs already
    res["aggregates"] = {n: {c: {k: v for k, v in a.items() if k not in per_request}
                             for c, a in rows.items()} for n, rows in aggs.items()}
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    md = markdown(res, aggs)
    (out / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
