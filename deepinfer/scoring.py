"""Teacher-forced scoring: the logits of every prompt token, through the engine's own paged
KV and prefix cache (accuracy checks of the KV codecs and tiers, tests, benchmarks)."""

from __future__ import annotations

from typing import Protocol

import torch

from .kv.cache_manager import KVCacheManager
from .model_runner import ModelRunner
from .overlap import OverlapScheduler
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler


class ScoredEngine(Protocol):
    """What scoring uses of ``LLMEngine``: typed here so this module does not import the engine."""

    overlap: OverlapScheduler | None
    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner
    requests: dict[str, Request]

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request: ...


def score_prompts(engine: ScoredEngine, prompts: list[list[int]],
                  cache_salt: str | None = None) -> list[tuple[torch.Tensor, int]]:
    """Teacher-forced logits: for each prompt, the logits of every token this call computes
    (all but its cached or replayed prefix) and that prefix's length. The prompts' pages are cached
    like any request's. Only for an otherwise idle engine (tests, evaluation, benchmarks)."""
    if engine.overlap is not None:
        engine.overlap.drain()  # a last step may still be in flight
    if engine.scheduler.has_work():
        raise RuntimeError("score() needs an idle engine")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params, cache_salt=cache_salt) for p in prompts]
    chunks: dict[int, list[torch.Tensor]] = {id(r): [] for r in reqs}
    left = set(map(id, reqs))
    while left:
        engine.kv.poll()
        batch = engine.scheduler.schedule()
        if not batch.items:
            engine.kv.wait_for_loads(0.05)
            continue
        logits = engine.runner.prompt_logits(batch.items)
        off = 0  # the runner puts one-token items first, then the longer chunks
        for req, n in sorted(batch.items, key=lambda it: it[1] > 1):
            chunks[id(req)].append(logits[off : off + n])
            off += n
            req.num_computed_tokens += n
            engine.kv.cache_pages(req)
            if req.num_computed_tokens >= req.num_tokens:
                engine.scheduler.finish(req, "length")
                engine.requests.pop(req.request_id, None)
                left.discard(id(req))
    # Replayed tokens (sliding-window models, kv/window/) were recomputed with a window
    # that may start short: their logits are not the model's, so they are left out.
    return [(torch.cat(chunks[id(r)])[r.num_replayed_tokens :],
             (r.num_cached_tokens or 0) + r.num_replayed_tokens) for r in reqs]
