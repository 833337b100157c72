"""LLMEngine: requests in, tokens out, one ``step()`` at a time.

Holds the tokenizer, the scheduler, the KV cache manager and the model runner, and applies
stop conditions. It is synchronous (``overlap.py`` runs forwards on a worker thread); the
server drives it from its own thread, the offline API from a loop.

Fault isolation: ``add_request`` checks every value against the ranges the step can use
(``limits.py``), and an exception in one request's own work (scheduling, hashing, sampling,
stop checks, caching its pages) ends that request alone with finish reason ``error``. A
batch whose forward pass raises is run again once, one request at a time, so only the
request that caused it fails; the others get the tokens they would have got.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from typing import TYPE_CHECKING

import torch

from .config import EngineConfig
from .errors import RequestError
from .hardware import describe_device
from .kv.build import build_cache_manager, build_tiers
from .kv.layout import describe
from .kv.radix import DEVICE, TIER_NAMES
from .kv.tiers.report import tier_fields
from .layers.sampler import SampleResult
from .limits import SEED_MAX, check_text, is_int
from .loader import load_checkpoint
from .log_limit import RateLimitedLog
from .model_runner import ModelRunner
from .overlap import OverlapScheduler
from .request import Request, SampleGroup
from .request_output import RequestOutput, request_output
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scoring import score_prompts
from .spec.step import build_decoder, emit_verified
from .stopping import StopRules
from .threads import CoreShare, apply_thread_policy

if TYPE_CHECKING:
    from .structured.grammar import GrammarCompiler

MAX_DEFAULT_LEN = 8192

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.thread_policy = apply_thread_policy(config.threads)
        self.cores = None if config.fixed_threads else CoreShare(self.thread_policy.threads)
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
        quant = self.runner.quant_plan
        self.model_identity = "|".join([
            ckpt.fingerprint, describe(self.runner.pool.specs), str(self.runner.dtype),
            f"page{config.page_size}"] + ([f"{quant.scheme}-{quant.kernel}"] if quant.scheme != "none" else []))
        self.startup_summary = (f"{describe_device(self.runner.device)}; dtype "
                                f"{str(self.runner.dtype).removeprefix('torch.')} ({config.dtype}); "
                                f"{self.thread_policy.describe()}"
                                f"{'' if config.fixed_threads else ', fewer where other processes take cores'}; "
                                f"{quant.describe()}; decode steps: "
                                f"{'native stack' if self.runner.decode_stack else 'modules'}")
        if config.progress:
            print(f"deepinfer: {self.startup_summary}", file=sys.stderr)
        self.tiers = build_tiers(config, self.runner.pool, self.model_identity)
        self.kv = build_cache_manager(config, self.runner.device_kv, self.model_identity, self.tiers)
        self.scheduler = Scheduler(config, self.kv)
        self.stop_rules = StopRules(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.failed_requests = 0  # requests ended by an exception in their own work
        self._errors = RateLimitedLog(log)
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.spec = None if config.speculative_config is None else build_decoder(
            config, ckpt, self.runner, self.kv,
            min(self.scheduler.max_chunk, config.max_num_batched_tokens), self.max_model_len)
        self.overlap = OverlapScheduler(self) if config.overlap_schedule else None

    def shutdown(self, timeout: float | None = 60.0) -> bool:
        """Graceful stop: wait for queued L2/L3 writes to land, stop the tier threads.
        Idempotent; True if every pending write finished in time."""
        if self.overlap is not None:
            self.overlap.close()
        if self.tiers is None:
            return True
        return self.tiers.close(timeout)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request:
        """Validate and queue a request; raises RequestError (naming the field) on bad input."""
        params.validate()
        if isinstance(prompt, str):
            check_text("prompt", prompt)
        ids = self.tokenize(prompt)
        self.validate_prompt(ids)
        vocab = self.hf_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens" if len(ids) < self.max_model_len else "prompt",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens")
        if cache_salt is not None:
            check_text("cache_salt", cache_salt)
        self._check_sampling(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        check_text("request_id", rid, nonempty=True)
        if rid in self.requests:
            raise RequestError("request_id", f"{rid!r} is already in use")
        req = Request(rid, ids, params, cache_salt=cache_salt)
        if params.structured_output is not None:
            compiler = self.grammar_compiler()
            req.grammar = compiler.matcher(compiler.compile(params.structured_output))
        self.requests[rid] = req
        try:
            self.scheduler.add(req)
        except Exception:
            del self.requests[rid]
            self.failed_requests += 1
            raise
        return req

    def validate_prompt(self, ids: list[int]) -> None:
        """Raise RequestError("prompt") unless ``ids`` are token ids the model can embed."""
        if not ids:
            raise RequestError("prompt", "must not be empty")
        vocab = self.hf_config.vocab_size
        if not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise RequestError("prompt", f"token ids must be integers in [0, {vocab})")

    def _check_sampling(self, params: SamplingParams) -> None:
        vocab = self.hf_config.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise RequestError("logit_bias", f"token ids must be in [0, {vocab})")
        k = params.num_samples
        if k > 1:
            field_name = "best_of" if params.best_of else "n"
            if k > self.config.max_num_seqs:
                raise RequestError(field_name, f"must be <= max_num_seqs "
                                               f"({self.config.max_num_seqs}), got {k}")

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this tokenizer (built on the first request)."""
        if self._grammars is None:
            from .structured.grammar import GrammarCompiler  # llguidance loads on first use

            self._grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size,
                                             sorted(self.eos_token_ids))
        return self._grammars

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples when it has several, even once the first ended)."""
        req = self.requests.get(request_id) or next(
            (r for r in self.requests.values() if r.group and r.group.request_id == request_id),
            None)
        members = req.group.members if req is not None and req.group else [req]
        for m in members:
            if m is not None:
                self.requests.pop(m.request_id, None)
                if not m.is_finished:
                    self.scheduler.finish(m, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.overlap is not None and self.overlap.in_flight is not None)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got a token or ended (finished ones, and
        failed ones: finish reason ``error``, ``req.error`` says why); with overlap, mostly
        those of the step launched the call before."""
        self.kv.poll()
        if self.cores is not None:
            self.cores.update()
        out = self.plain_step() if self.overlap is None else self.overlap.step()
        return out + self._take_failed()

    def plain_step(self) -> list[Request]:
        """Schedule, run and land one batch (no step in flight)."""
        batch = self.scheduler.schedule()
        if not batch.items:
            self.wait_for_loads()
            return []
        if self.spec is not None:
            return self._step_speculative(batch.items, batch.num_tokens)
        return [r for part in self._forward(batch.items) for r in self._advance(*part)]

    def wait_for_loads(self) -> None:
        if self.scheduler.waiting and self.kv.loads_in_flight():
            self.kv.wait_for_loads(0.05)  # only loading requests are left: no busy loop

    def _forward(self, items: list[tuple[Request, int]]
                 ) -> list[tuple[list[tuple[Request, int]], list[Request], torch.Tensor | None]]:
        """Run the batch. If it raises as a whole, run each request alone once, so only the
        one that caused it fails (rewriting a page slot with the same KV is harmless)."""
        try:
            return [(items, *self.runner.forward(items))]
        except Exception as e:  # noqa: BLE001
            if len(items) == 1:
                self.scheduler.fail(items[0][0], e)
                return []
            self._errors.error("batch", "a batch of %d requests failed (%s: %s); running each "
                               "alone", len(items), type(e).__name__, e)
        parts = []
        for item in items:
            try:
                parts.append(([item], *self.runner.forward([item])))
            except Exception as e:  # noqa: BLE001
                self.scheduler.fail(item[0], e)
        return parts

    def _step_speculative(self, items: list[tuple[Request, int]], num_tokens: int) -> list[Request]:
        """A step with verify spans (spec/); if it raises, the batch runs plain (and isolated)."""
        assert self.spec is not None
        try:
            spec = self.spec.forward(items, self.config.max_num_batched_tokens - num_tokens)
        except Exception as e:  # noqa: BLE001
            self._errors.error("batch", "a speculative step failed (%s: %s); running it plain",
                               type(e).__name__, e)
            return [r for part in self._forward(items) for r in self._advance(*part)]
        out = self._advance(items, spec.sampled, spec.logits)
        verified = emit_verified(spec.verified, self.kv, self._check_stop, time.monotonic())
        for req in verified:
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        out += verified
        for req in out:
            if req.is_finished:
                self.spec.observe(req)  # shared draft sources learn finished sequences
        return out

    def _advance(self, items: list[tuple[Request, int]], sampled: list[Request],
                 logits: torch.Tensor | None) -> list[Request]:
        """Apply a forward pass to its requests: cache their pages, sample, check stops. An
        exception in one request's part fails that request alone."""
        prefilled: list[Request] = []  # prefill_only requests whose prompt is done: no sampling
        for req, n in items:
            try:
                self.count_computed(req, n)
                self.kv.cache_pages(req)
                if req.params.prefill_only and req.num_computed_tokens >= req.num_tokens:
                    self.scheduler.finish(req, "prefill")
                    prefilled.append(self.requests.pop(req.request_id, req))
            except Exception as e:  # noqa: BLE001
                self.scheduler.fail(req, e)
        rows = [i for i, r in enumerate(sampled) if not (r.is_finished or self.kv.take_rewound(r))]
        if not rows:
            return prefilled
        if len(rows) < len(sampled):
            sampled = [sampled[i] for i in rows]
            logits = logits[torch.tensor(rows, device=logits.device)]
        if any(r.awaiting_fork for r in sampled):
            sampled, fork_rows = self._fork(sampled)
            logits = logits[torch.tensor(fork_rows, device=logits.device)]
        return prefilled + self.commit(*self.runner.sample(sampled, logits))

    def count_computed(self, req: Request, n: int) -> int:
        """Count ``n`` more tokens of ``req`` as computed; returns how many were prompt tokens."""
        prompt = max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
        self.kv.stats.computed_prompt_tokens += prompt
        req.num_computed_tokens += n
        return prompt

    def commit(self, sampled: list[Request], result: SampleResult | None,
               failed: list[tuple[Request, Exception]]) -> list[Request]:
        """Append each sampled token and check stops; fail the requests whose sampling raised.
        A request that finished while its step was in flight (overlap) drops its token."""
        for req, e in failed:
            if not req.is_finished:
                self.scheduler.fail(req, e)
        now = time.monotonic()
        out = []
        for i, req in enumerate(sampled):
            if req.is_finished:
                continue
            try:
                self._append(req, i, result, now)
            except Exception as e:  # noqa: BLE001
                self.scheduler.fail(req, e)
                continue
            if req.is_finished:
                req.finish_time = now
                self.requests.pop(req.request_id, None)
            out.append(req)
        return out

    def _append(self, req: Request, i: int, result: SampleResult, now: float) -> None:
        tok = result.tokens[i]
        req.output_token_ids.append(tok)
        lp = None if result.logprobs is None else result.logprobs[i]
        if lp is not None:
            req.logprobs.append(lp)
            req.top_logprobs.append(result.top_logprobs[i])
            req.cumulative_logprob += lp
        if req.grammar is not None and not req.grammar.accept(tok):
            raise RuntimeError(f"{req.request_id}: sampled token {tok} is outside its grammar")
        if req.first_token_time is None:
            req.first_token_time = now
        self._check_stop(req)

    def _take_failed(self) -> list[Request]:
        failed = self.scheduler.take_failed()
        now = time.monotonic()
        for req in failed:
            req.finish_time = now
            self.requests.pop(req.request_id, None)
            self.failed_requests += 1
            self._errors.error("request", "request %s failed alone: %s", req.request_id, req.error)
        return failed

    def _fork(self, sampled: list[Request]) -> tuple[list[Request], list[int]]:
        """Fork each request whose prompt just finished into its ``num_samples`` sequences.

        The first sample is the request itself; the others share its prompt's KV (tree pages
        locked once more, its own partial page copied) and each draw their first token from
        the same logits row. Returns the sequences to sample and their logits rows."""
        out: list[Request] = []
        rows: list[int] = []
        copies: list[tuple[int, int]] = []
        for i, req in enumerate(sampled):
            out.append(req)
            rows.append(i)
            if not req.awaiting_fork:
                continue
            req.group = SampleGroup(req.request_id, [req])
            for k in range(1, req.params.num_samples):
                child = self._child(req, k)
                pairs = self.kv.fork(req, child)
                self.scheduler.add_fork(child, running=pairs is not None)
                copies += pairs or []
                out.append(child)
                rows.append(i)
        self.runner.copy_pages(copies)
        return out, rows

    def _child(self, req: Request, k: int) -> Request:
        p = req.params
        # (modulo the seed range, as torch reads seeds: a valid seed + k stays valid)
        params = p if p.seed is None else dataclasses.replace(p, seed=(p.seed + k) % (SEED_MAX + 1))
        child = Request(f"{req.request_id}#{k}", req.prompt_token_ids, params,
                        cache_salt=req.cache_salt, arrival_time=req.arrival_time,
                        # its whole prompt came from the shared prefill
                        num_cached_tokens=req.num_prompt_tokens,
                        cached_tokens_by_tier={TIER_NAMES[DEVICE]: req.num_prompt_tokens},
                        group=req.group, sample_index=k,
                        grammar=None if req.grammar is None else req.grammar.fresh())
        req.group.members.append(child)
        self.requests[child.request_id] = child
        return child

    def _check_stop(self, req: Request) -> None:
        reason = self.stop_rules.finish_reason(req)
        if reason is not None:
            self.scheduler.finish(req, reason)

    # ------------------------------------------------------------------ outputs
    def output_text(self, req: Request) -> str:
        return self.stop_rules.output_text(req)

    def make_output(self, req: Request) -> RequestOutput:
        return request_output(req, self.output_text(req))

    def group_outputs(self, req: Request) -> list[RequestOutput]:
        """The outputs a request returns: itself, or its ``n`` chosen samples (index 0..n-1)."""
        if req.group is None:
            return [self.make_output(req)]
        return [dataclasses.replace(self.make_output(m), index=j)
                for j, m in enumerate(req.group.chosen())]

    def run_to_completion(self, reqs: list[Request]) -> list[RequestOutput]:
        """Step until every request (and every sample of it) is done; its outputs in order."""
        while any(not r.is_finished or (r.group is not None and not r.group.is_finished)
                  for r in reqs):
            self.step()
        if self.overlap is not None:
            self.overlap.drain()  # a last step may still compute tokens nobody keeps
        return [o for r in reqs for o in self.group_outputs(r)]

    def stats(self) -> dict:
        """Counters and gauges (the server exports every number; dicts by tier as labels); the
        lower tiers' fields are ``kv/tiers/report.py``'s."""
        s = self.kv.stats
        out = {
            "prefix_cache_queries": s.query_tokens,
            "prefix_cache_hits": s.hit_tokens,
            "computed_prompt_tokens": s.computed_prompt_tokens,
            "evicted_pages": s.evicted_pages,
            "preemptions": s.preemptions,
            "free_pages": self.kv.num_free_pages,
            "total_pages": self.runner.pool.allocator.num_pages,
            "failed_requests_total": self.failed_requests,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "compute_threads": self.thread_policy.threads if self.cores is None else self.cores.threads,
            "other_processes_cores": 0.0 if self.cores is None else self.cores.others,
            "cache_hit_tokens_by_tier": dict(s.hit_tokens_by_tier),
        }
        out.update(self.kv.window_stats())  # sliding-window rings and snapshots (if any)
        if self.spec is not None:
            out.update(self.spec.stats())
        t = self.kv.tier_stats()
        if t:
            out.update(tier_fields(s, t))
        return out

    # ------------------------------------------------------------------ scoring
    def score(self, prompts: list[list[int]], cache_salt: str | None = None) -> list[tuple[torch.Tensor, int]]:
        """Teacher-forced logits of ``prompts`` (``scoring.py``); only for an idle engine."""
        return score_prompts(self, prompts, cache_salt)
