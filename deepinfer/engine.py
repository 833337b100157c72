"""LLMEngine: requests in, tokens out, one ``step()`` at a time.

Holds the tokenizer, the scheduler, the KV cache manager and the model runner, and applies
stop conditions. It is synchronous and single-threaded; the server drives it from its own
thread, the offline API from a loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from .config import EngineConfig
from .errors import RequestError
from .kv.cache_manager import KVCacheManager
from .kv.layout import describe
from .loader import load_checkpoint
from .model_runner import ModelRunner
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler

MAX_DEFAULT_LEN = 8192


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the cache
    num_computed_tokens: int  # prompt tokens prefilled by this request (prompt - cached)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ttft: float | None = None
    latency: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        ckpt = load_checkpoint(config.model, progress=config.progress)
        self.model_name = ckpt.name
        self.checkpoint_path = ckpt.path
        self.tokenizer = ckpt.tokenizer
        self.hf_config = ckpt.config
        self.eos_token_ids = set(ckpt.eos_token_ids)
        limit = getattr(ckpt.config, "max_position_embeddings", MAX_DEFAULT_LEN)
        self.max_model_len = config.max_model_len or min(limit, MAX_DEFAULT_LEN)
        self.runner = ModelRunner(config, ckpt, self.max_model_len)
        capacity = (self.runner.pool.allocator.num_pages - 1) * config.page_size
        if config.max_model_len is None:
            self.max_model_len = min(self.max_model_len, capacity)
        elif capacity < self.max_model_len:
            raise ValueError(f"KV pool holds {capacity} tokens, less than max_model_len="
                             f"{self.max_model_len}; raise --num-pages/--kv-cache-memory-gb")
        self.model_identity = "|".join([
            ckpt.fingerprint, describe(self.runner.specs), str(self.runner.dtype),
            f"page{config.page_size}"])
        self.kv = KVCacheManager(self.runner.pool.allocator, config.page_size,
                                 self.model_identity, config.enable_prefix_cache,
                                 config.max_node_pages)
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Validate and queue a request; raises RequestError (naming the field) on bad input."""
        params.validate()
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("prompt", "must not be empty")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise RequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens" if len(ids) < self.max_model_len else "prompt",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt", "must be a string")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError("request_id", f"{rid!r} is already in use")
        req = Request(rid, ids, params, cache_salt=cache_salt)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Request]:
        """Run one batch; returns requests that got a token (finished ones included)."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        sampled, result = self.runner.execute(batch.items)
        for req, n in batch.items:
            req.num_computed_tokens += n
            self.kv.cache_pages(req)
        now = time.monotonic()
        for i, req in enumerate(sampled):
            req.output_token_ids.append(result.tokens[i])
            if result.logprobs is not None:
                req.logprobs.append(result.logprobs[i])
                req.top_logprobs.append(result.top_logprobs[i])
            if req.first_token_time is None:
                req.first_token_time = now
            self._check_stop(req)
            if req.is_finished:
                req.finish_time = now
                self.requests.pop(req.request_id, None)
        return sampled

    def _check_stop(self, req: Request) -> None:
        p, tok = req.params, req.output_token_ids[-1]
        if not p.ignore_eos and tok in self.eos_token_ids:
            req.stop_reason = tok
            self.scheduler.finish(req, "stop")
        elif tok in p.stop_token_ids:
            req.stop_reason = tok
            self.scheduler.finish(req, "stop")
        elif p.stop and any(s in self._tail_text(req, s) for s in p.stop):
            req.stop_reason = next(s for s in p.stop if s in self._tail_text(req, s))
            self.scheduler.finish(req, "stop")
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, "length")

    def _tail_text(self, req: Request, stop: str) -> str:
        # A stop string can only end in the newest token; decode just enough tokens to see it.
        n = min(len(req.output_token_ids), len(stop) + 4)
        return self.tokenizer.decode(req.output_token_ids[-n:], skip_special_tokens=False)

    # ------------------------------------------------------------------ outputs
    def output_text(self, req: Request) -> str:
        """Generated text, cut before a matched stop string (which is not returned)."""
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        if isinstance(req.stop_reason, str):
            cut = text.find(req.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text

    def make_output(self, req: Request) -> RequestOutput:
        cached = req.num_cached_tokens or 0
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self.output_text(req),
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=cached,
            num_computed_tokens=req.num_prompt_tokens - cached,
            cached_tokens_by_tier=dict(req.cached_tokens_by_tier),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
            ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            latency=None if req.finish_time is None else req.finish_time - req.arrival_time,
        )

    def run_to_completion(self, reqs: list[Request]) -> list[RequestOutput]:
        while any(not r.is_finished for r in reqs):
            self.step()
        return [self.make_output(r) for r in reqs]

    def stats(self) -> dict:
        s = self.kv.stats
        return {
            "prefix_cache_queries": s.query_tokens,
            "prefix_cache_hits": s.hit_tokens,
            "evicted_pages": s.evicted_pages,
            "preemptions": s.preemptions,
            "free_pages": self.kv.num_free_pages,
            "total_pages": self.runner.pool.allocator.num_pages,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }
