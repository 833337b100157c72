"""The engine thread's bookkeeping of the requests it streams: each one's ``Live`` state,
handing deltas to the event loop, a multi-sample request's last deltas, usage and counters
of an ended request, and token logprobs as text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..request import Request, SampleGroup
from .cache_control import creation_tokens
from .detokenize import TextStream
from .metrics import ServerMetrics
from .outputs import Delta, Submission, Usage
from .prompts import BuiltPrompt


@dataclass
class Live:
    """A request the engine thread streams to its client's queue."""

    sub: Submission
    req: Request
    queue: asyncio.Queue
    stream: TextStream
    prompt: BuiltPrompt
    num_sent_ids: int = 0
    index: int = 0  # its sample's place among the request's n
    samples_done: int = 0  # (the first sample's) samples whose end was published
    breakpoints: list[int] = field(default_factory=list)  # token positions of cache_control marks


def deliver(batch: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, d in batch:
        q.put_nowait(d)


def group_end(root: Live, group: SampleGroup, final: Delta, ranked: bool, tokenizer: PreTrainedTokenizerBase,
              output_text: Callable[[Request], str]) -> list[Delta]:
    """The last deltas of a request with several samples: the last sample's end, or with
    best_of the chosen samples whole; the last carries the request's usage (the prompt
    once, the returned samples' tokens)."""
    chosen = group.chosen()
    out = [final]
    if ranked:
        want = root.sub.parsed.want_logprobs
        out = [Delta(output_text(m), list(m.output_token_ids),
                     token_logprobs(tokenizer, m, 0, len(m.output_token_ids)) if want else None,
                     m.finish_reason, index=j) for j, m in enumerate(chosen)]
    first = group.members[0]
    out[-1].usage = Usage(first.num_prompt_tokens,
                          sum(len(m.output_token_ids) for m in chosen),
                          min(first.num_cached_tokens or 0, first.num_prompt_tokens),
                          {k: v for k, v in first.cached_tokens_by_tier.items() if v})
    return out


def account(live: Live, reason: str, metrics: ServerMetrics, page_size: int) -> Usage:
    """Usage of an ended request; adds it to the server's counters."""
    req, m = live.req, metrics
    n_prompt = req.num_prompt_tokens
    hit = min(req.num_cached_tokens or 0, n_prompt)
    usage = Usage(n_prompt, len(req.output_token_ids), hit,
                  {k: v for k, v in req.cached_tokens_by_tier.items() if v},
                  creation_tokens(live.breakpoints, page_size, n_prompt, hit), live.sub.prefill,
                  req.store_cached_tokens, req.prefill_worker_cached_tokens,
                  req.spec if req.spec.source else None,
                  req.load_stats if req.load_stats.seconds else None)
    m.finished[reason] = m.finished.get(reason, 0) + 1
    m.prompt_tokens += n_prompt if req.sample_index == 0 else 0  # samples share the prompt
    m.generation_tokens += usage.completion_tokens
    for t, v in req.cached_tokens_by_tier.items():
        m.cached_by_tier[t] = m.cached_by_tier.get(t, 0) + v
    now = time.monotonic()
    arrival = live.sub.arrival
    if req.first_token_time is not None:
        m.ttft.observe(req.first_token_time - arrival)
        n = len(req.output_token_ids)
        if n > 1:
            m.tpot.observe(((req.finish_time or now) - req.first_token_time) / (n - 1))
    if reason != "abort":
        m.e2e.observe(now - arrival)
    if req.load_stats.seconds:
        m.load_seconds.observe(req.load_stats.seconds)
        m.load_gb_per_s.observe(req.load_stats.gb_per_s)
    return usage


def token_logprobs(tokenizer: PreTrainedTokenizerBase, req: Request, start: int, end: int) -> list[dict]:
    """The sampled tokens ``start:end`` with their logprobs and top alternatives, as text."""
    dec = tokenizer.decode
    out = []
    for i in range(start, min(end, len(req.logprobs))):
        tid = req.output_token_ids[i]
        tops = req.top_logprobs[i] if i < len(req.top_logprobs) else []
        out.append({"id": tid, "token": dec([tid]), "logprob": float(req.logprobs[i]),
                    "top": [(t, dec([t]), float(lp)) for t, lp in (tops or [])]})
    return out
