"""SPS(B) measured at start-up on the engine's own device and model: one forward of B new
tokens (a throwaway sequence on freshly allocated pages, never cached) per point."""

from __future__ import annotations

import time

import torch

from ..kv.cache_manager import KVCacheManager
from ..model_runner import ModelRunner
from ..request import Request
from ..sampling_params import SamplingParams
from .verify_schedule import SpsProfile


def profile_sps(runner: ModelRunner, kv: KVCacheManager, max_tokens: int, vocab_size: int,
                repeats: int = 3) -> SpsProfile:
    sizes = [1]
    while sizes[-1] * 2 <= max_tokens:
        sizes.append(sizes[-1] * 2)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rates = []
    for b in sizes:
        req = Request("sps-profile", [i % vocab_size for i in range(b)], params)
        if not kv.allocate(req, b):
            raise RuntimeError(f"KV pool too small to profile a {b}-token step")
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            _sync(runner.device)
            t0 = time.perf_counter()
            runner.forward([(req, b)])
            _sync(runner.device)
            times.append(time.perf_counter() - t0)
        kv.release(req)
        rates.append(1.0 / sorted(times[1:])[len(times[1:]) // 2])
    return SpsProfile(sizes, rates)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
