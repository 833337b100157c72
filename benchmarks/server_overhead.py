"""Server-path overhead: milliseconds per output token offline vs streamed over HTTP (SSE), one
engine, the same prompt, rounds interleaved; and where the streamed path's extra time goes.

    python benchmarks/server_overhead.py                      # SmolLM2, 64-token prompt, 48 tokens
    python benchmarks/server_overhead.py --prompt-len 2700 --threads 2
    python benchmarks/server_overhead.py --prompt-len 1500 --threads 2 --quantization int4   # the agent workload's

Per token (decode only: from the first token to the last, so prefill is left out):
* ``offline``: the engine stepped on its own thread (``AsyncEngine.call_sync``), no HTTP;
* ``streamed``: the same request streamed from ``/v1/completions``, chunk arrival times at the client;
* ``streamed_step``: of that, the time inside ``LLMEngine.step`` (the forward and its bookkeeping);
  the rest is the server's share: the engine thread's hand-off (deltas, detokenization, the
  outbox to the event loop), the event loop (SSE framing) and the client.
"""

from __future__ import annotations

import argparse
import json
import time

import deepinfer  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
import httpx
import torch
from deepinfer.config import EngineConfig
from deepinfer.engine import LLMEngine
from deepinfer.hardware import lscpu_model
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.config import ServerConfig
from deepinfer.server.serve import BackgroundServer


class StepClock:
    """Wraps ``engine.step``: the seconds spent inside it since ``reset``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine.step
        self.seconds = 0.0
        engine.step = self.step

    def step(self):
        t0 = time.perf_counter()
        try:
            return self.inner()
        finally:
            self.seconds += time.perf_counter() - t0


def offline_ms(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    """Runs on the engine thread: step one request to its end, ms per token after the first."""
    req = engine.add_request(prompt, params)
    stamps = []
    while not req.is_finished:
        if req in engine.step():
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


def streamed_ms(url: str, prompt: list[int], n: int, clock: StepClock) -> tuple[float, float]:
    """ms per token after the first at the client, and ms per token inside ``engine.step``."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    first = last = None
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/completions",
                                                            json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                last = time.perf_counter()
                if first is None:
                    first, clock.seconds = last, 0.0
    step_s = clock.seconds  # (the last step's time lands before its chunk is sent)
    return (last - first) / (n - 1) * 1000, step_s / (n - 1) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--overlap-schedule", action="store_true")
    p.add_argument("--quantization", default="none", help="none | int8 | int4 (the agent benchmark runs int4)")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(enable_prefix_cache=False, host_cache_gb=0, enable_disk_cache=False,
                                    progress=False, threads=args.threads, quantization=args.quantization,
                                    overlap_schedule=args.overlap_schedule))
    clock = StepClock(engine)
    srv = BackgroundServer(engine, ServerConfig(port=0, log_level="warning")).start()
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    best = {"offline": float("inf"), "streamed": float("inf"), "streamed_step": float("inf")}
    try:
        streamed_ms(srv.url, prompt, 4, clock)  # warm-up
        for _ in range(args.rounds):
            off = srv.async_engine.call_sync(lambda: offline_ms(engine, prompt, params), timeout=600)
            st, st_step = streamed_ms(srv.url, prompt, args.new_tokens, clock)
            best["offline"] = min(best["offline"], off)
            if st < best["streamed"]:
                best["streamed"], best["streamed_step"] = st, st_step
    finally:
        srv.stop()
        engine.shutdown()
    row = {k: round(v, 2) for k, v in best.items()}
    row["server_share_ms"] = round(best["streamed"] - best["streamed_step"], 2)
    row["streamed_minus_offline_ms"] = round(best["streamed"] - best["offline"], 2)
    print(json.dumps(row))
    print(f"CPU: {lscpu_model()}; {engine.thread_policy.describe()}; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; ms per output token, best of {args.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
