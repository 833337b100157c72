"""What the engine thread hands to the HTTP side: admissions, output deltas and usage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..kv.tiers.backend import LoadStats
from ..spec.counters import SpecCounters
from .api_error import APIError
from .prompts import BuiltPrompt
from .protocol import ParsedRequest
from .tools import ToolOutput


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    cache_creation_tokens: int = 0  # computed prompt tokens now cached up to a cache_control mark
    prefill_worker: dict[str, int | float] | None = None  # the prompt's prefill elsewhere (pd.py)
    store_cached_tokens: int = 0  # of the disk tier's, those the networked store served
    prefill_worker_cached_tokens: int = 0  # of the disk tier's, those a prefill worker sent
    speculative: SpecCounters | None = None  # a request that ran with speculative decoding
    kv_load: LoadStats | None = None  # its prompt's loads from L2/L3 (None: nothing loaded)

    def to_dict(self) -> dict:
        hit = self.cached_tokens
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_cache_hit_tokens": hit,  # DeepSeek
            "prompt_cache_miss_tokens": self.prompt_tokens - hit,
            "prompt_tokens_details": {"cached_tokens": hit,  # OpenAI
                                      "cached_tokens_by_tier": dict(self.cached_tokens_by_tier),
                                      "cached_tokens_from_store": self.store_cached_tokens,
                                      "cached_tokens_from_prefill_worker":
                                          self.prefill_worker_cached_tokens},
        }
        if self.prefill_worker is not None:
            out["prefill_worker"] = dict(self.prefill_worker)
        if self.speculative is not None:
            out["speculative"] = self.speculative.to_dict()
        if self.kv_load is not None:
            out["kv_load"] = self.kv_load.to_dict()
        return out


@dataclass
class Delta:
    """New output of one request since the last delta (posted to its asyncio queue)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # {"id", "token", "logprob", "top": [(id, token, lp)]}
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    index: int = 0  # the choice (sample) it belongs to, when the request has n > 1
    tool_output: ToolOutput | None = None  # final delta of a request with tools: the parsed reply
    stop_string: str | None = None  # final delta: the stop string that ended the reply

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def merge_deltas(a: Delta, b: Delta) -> Delta:
    """One delta for two consecutive ones (a slow reader gets fewer, larger chunks)."""
    lps = None if a.logprobs is None and b.logprobs is None else \
        (a.logprobs or []) + (b.logprobs or [])
    return Delta(a.text + b.text, a.token_ids + b.token_ids, lps, b.finish_reason, b.usage,
                 b.error, a.index, b.tool_output, b.stop_string)


@dataclass
class Admitted:
    request_id: str
    prompt: BuiltPrompt
    num_prompt_tokens: int


@dataclass
class Submission:
    request_id: str
    parsed: ParsedRequest
    arrival: float = field(default_factory=time.monotonic)
    prompt: BuiltPrompt | None = None  # built already (a prefill worker's request: server/pd.py)
    prefill: dict[str, int | float] | None = None  # the prefill worker's counts (decode role)


class QueueFull(APIError):
    def __init__(self, retry_after: int, limit: int) -> None:
        super().__init__(429, f"the server is at capacity ({limit} requests running or queued); "
                              f"retry after {retry_after}s", type="rate_limit_exceeded",
                         code="queue_full", headers={"Retry-After": str(retry_after)})
