"""Routing across workers (issue 15): hit rate, TTFT p50/p90 and total time of one workload
through ``deepinfer router`` (round_robin, kv), through ``sglang-router`` (cache_aware) in
front of the same workers, and on one engine holding all the memory, side by side in one run.

Two ``deepinfer serve`` workers of the embedded SmolLM2 (``--threads 1`` each, ``--num-pages``
small so one worker cannot hold every conversation), started fresh for every (config,
workload): no config inherits another's cache. The workloads are ``deepinfer.bench``'s
multi-turn chat and agent loop, driven by its client (streamed requests; TTFT measured at the
client, cached tokens from each response's usage).

    python benchmarks/router.py [--quick] [--pages 80] [--out results/router]
        [--configs kv,round_robin] [--workloads chat] [--kv-args "--overlap-weight 2"]

Writes ``summary.json`` and ``summary.md`` under ``--out``; prints the CPU model with them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deepinfer.bench.client import ClientConfig, run_workload
from deepinfer.bench.metrics import summarize
from deepinfer.bench.workloads import agent_loop, multi_turn_chat
from deepinfer.hardware import lscpu_model

CONFIGS = ("single_engine_2x", "round_robin", "kv", "sglang_cache_aware")


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


def start_workers(n: int, pages: int, max_len: int, logs: Path) -> tuple[list[str], list]:
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        procs.append(spawn([sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port),
                            "--threads", "1", "--num-pages", str(pages), "--max-model-len",
                            str(max_len), "--no-disk-cache", "--host-cache-gb", "0",
                            "--log-level", "warning"], logs / f"worker{i}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    for u, p in zip(urls, procs):
        wait_ready(u, p)
    return urls, procs


def start_front(config: str, workers: list[str], logs: Path,
                kv_args: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    if config == "sglang_cache_aware":
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--policy", "cache_aware", "--worker-urls", *workers,
                "--log-level", "warn"]
    else:
        args = [sys.executable, "-m", "deepinfer.cli", "router", "--port", str(port),
                "--policy", config, "--log-level", "info",  # info: its placement log
                *[a for w in workers for a in ("--worker", w)],
                *(kv_args if config == "kv" else [])]
    proc = spawn(args, logs / f"{config}.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "/v1/models" if config == "sglang_cache_aware" else "/health")
    return url, proc


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def workloads(quick: bool) -> dict:
    users, turns, agents, steps = (4, 3, 3, 3) if quick else (8, 4, 6, 4)
    return {
        "chat": multi_turn_chat(num_users=users, turns=turns, system_tokens=160,
                                user_tokens=48, max_tokens=16),
        "agent": agent_loop(num_agents=agents, steps=steps, num_tools=3, task_tokens=48,
                            tool_output_tokens=64, tool_output_growth=32, max_tokens=16,
                            tool_format="text"),
    }


def placements(log: Path, workers: list[str]) -> list[dict]:
    """The router's placement log (``deepinfer.router.placement``), in order of routing:
    which worker (0, 1) got each request, its prompt tokens, predicted hit pages, the costs."""
    out = []
    for line in log.read_text().splitlines():
        if "placement {" in line:
            p = json.loads(line[line.index("placement {") + len("placement "):])
            out.append({"worker": workers.index(p["worker"]), "prompt_tokens": p["prompt_tokens"],
                        "hit_pages": p["hit_pages"],
                        "costs": [p["costs"].get(w) for w in workers],
                        "loads": [p["loads"].get(w) for w in workers]})
    return out


def run_one(config: str, wl, pages: int, max_len: int, concurrency: int, logs: Path,
            kv_args: list[str]) -> dict:
    single = config == "single_engine_2x"
    workers, procs = start_workers(1 if single else 2, pages * 2 if single else pages, max_len,
                                   logs)
    try:
        base = workers[0]
        if not single:
            base, front = start_front(config, workers, logs, kv_args)
            procs.append(front)
        model = httpx.get(workers[0] + "/v1/models").json()["data"][0]["id"]
        cfg = ClientConfig(base_url=base, model=model, concurrency=concurrency,
                           request_timeout_s=600, progress=False)
        t0 = time.perf_counter()
        records = run_workload(cfg, wl)
        total = time.perf_counter() - t0
        s = summarize(records)
        errors = [r.error for r in records if not r.ok][:3]
        placed = [] if single or config == "sglang_cache_aware" else placements(
            logs / f"{config}.log", workers)
        return {"placements": placed, "hit_rate": s["hit_rate"],
                "ttft_p50_s": s["ttft_s"].get("p50"),
                "ttft_p90_s": s["ttft_s"].get("p90"), "total_s": total,
                "requests": s["num_requests"], "errors": s["num_errors"],
                "first_errors": errors, "prompt_tokens": s["prompt_tokens"],
                "cached_tokens": s["cached_tokens"]}
    except RuntimeError as e:
        return {"failed": str(e)}
    finally:
        stop(procs)


def markdown(res: dict) -> str:
    lines = [f"CPU: {res['cpu']}; {res['note']}", ""]
    for name, rows in res["workloads"].items():
        lines += [f"### {name}", "", "| config | hit rate | TTFT p50 | TTFT p90 | total | errors |",
                  "|---|---:|---:|---:|---:|---:|"]
        for cfg, r in rows.items():
            if "failed" in r:
                lines.append(f"| {cfg} | failed: {r['failed']} | | | | |")
                continue
            p50, p90 = r["ttft_p50_s"], r["ttft_p90_s"]
            lines.append(f"| {cfg} | {r['hit_rate']:.1%} | {p50 * 1e3:.0f} ms | "
                         f"{p90 * 1e3:.0f} ms | {r['total_s']:.1f} s | {r['errors']} |")
        for cfg, r in rows.items():
            if r.get("placements"):
                seq = " ".join(f"{'ab'[p['worker']]}{p['hit_pages']}" for p in r["placements"])
                lines.append(f"\n{cfg} placements (worker, predicted hit pages): {seq}")
        one, kv = rows.get("single_engine_2x", {}), rows.get("kv", {})
        if one.get("hit_rate") and kv.get("hit_rate") is not None:
            lines += ["", f"kv hit rate / single engine's: {kv['hit_rate'] / one['hit_rate']:.1%}"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sessions and turns")
    ap.add_argument("--pages", type=int, default=80, help="KV pages (16 tokens) per worker")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default="chat,agent")
    ap.add_argument("--out", default="results/router")
    ap.add_argument("--kv-args", default="", help="extra `deepinfer router` options of the kv "
                                                  "row, e.g. \"--overlap-weight 2\"")
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    wls = workloads(args.quick)
    res = {"cpu": lscpu_model(), "pages_per_worker": args.pages, "quick": args.quick,
           "concurrency": args.concurrency, "kv_args": args.kv_args, "workloads": {},
           "note": f"2 workers x {args.pages} pages of 16 tokens, --threads 1 each; single "
                   f"engine: {2 * args.pages} pages; client concurrency {args.concurrency}"}
    for name in args.workloads.split(","):
        rows = res["workloads"][name] = {}
        for config in args.configs.split(","):
            print(f"{name} / {config} ...", file=sys.stderr, flush=True)
            rows[config] = run_one(config, wls[name], args.pages, args.max_model_len,
                                   args.concurrency, logs, args.kv_args.split())
            print(f"  {rows[config]}", file=sys.stderr, flush=True)
    (out / "summary.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "summary.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
