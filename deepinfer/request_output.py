"""RequestOutput: what a finished (or streamed) request hands back to its caller: tokens,
text, finish reason, and where its prompt's KV came from (cache tiers, replay, compute)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the cache
    num_computed_tokens: int  # prompt tokens prefilled by this request (prompt - cached - replayed)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ttft: float | None = None
    latency: float | None = None
    # prompt tokens of the prefix hit recomputed for sliding-window layers (kv/window/);
    # cached + replayed + computed == prompt tokens
    num_replayed_tokens: int = 0
    index: int = 0  # which of the request's ``n`` samples (ranked by best_of when it is set)
    cumulative_logprob: float | None = None  # of the sampled tokens (with logprobs or best_of)
    error: str | None = None  # finish reason "error": what failed this request alone
    # its loads from L2/L3: seconds from queueing to data in L1, seconds reading and bytes read
    # by tier, and the effective throughput (bytes over the whole wait)
    load_seconds: float = 0.0
    load_seconds_by_tier: dict[str, float] = field(default_factory=dict)
    load_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    load_gb_per_s: float = 0.0
    # speculative decoding (spec/): draft tokens proposed, verified, accepted; verify steps
    num_drafted_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0


def request_output(req: Request, text: str) -> RequestOutput:
    """What a request returns (one sample of it), its generated ``text`` given."""
    cached, p = req.num_cached_tokens or 0, req.params
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=text,
        finish_reason=req.finish_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=cached,
        num_computed_tokens=req.num_prompt_tokens - cached - req.num_replayed_tokens,
        cached_tokens_by_tier=dict(req.cached_tokens_by_tier),
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
        ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
        latency=None if req.finish_time is None else req.finish_time - req.arrival_time,
        num_replayed_tokens=req.num_replayed_tokens,
        num_drafted_tokens=req.spec.drafted,
        num_verified_tokens=req.spec.verified,
        num_accepted_tokens=req.spec.accepted,
        num_verify_steps=req.spec.steps,
        index=req.sample_index,
        cumulative_logprob=req.cumulative_logprob
        if p.logprobs is not None or p.num_samples > p.n else None,
        error=req.error,
        load_seconds=req.load_stats.seconds,
        load_seconds_by_tier=dict(req.load_stats.seconds_by_tier),
        load_bytes_by_tier=dict(req.load_stats.bytes_by_tier),
        load_gb_per_s=req.load_stats.gb_per_s,
    )
