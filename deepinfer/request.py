"""One sequence's state as it moves waiting -> running -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kv.radix import Node
from .kv.tiers.backend import LoadJob, LoadStats
from .kv.window.rings import RingState
from .sampling_params import SamplingParams
from .spec.counters import SpecCounters

if TYPE_CHECKING:
    from .structured.grammar import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # finish reason "error": the exception that ended this request alone
    stop_reason: int | str | None = None
    # KV state
    pages: list[int] = field(default_factory=list)  # L1 page table
    num_computed_tokens: int = 0  # tokens whose KV is in ``pages`` (or written by a step in flight)
    # overlap scheduling: tokens a step in flight samples, not known yet (the next step's input)
    num_pending_tokens: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full pages
    num_tree_pages: int = 0  # leading pages of ``pages`` owned by the radix tree
    locked_node: Node | None = None
    # lower KV tiers (see kv/cache_manager.py)
    kv_load: LoadJob | None = None  # bringing the L2/L3 part of the cached prefix back to L1
    kv_prefetched: bool = False  # the lookup for this admission attempt was done
    kv_rewound: bool = False  # its last step ran on streamed pages that failed their check
    kv_hit_counted: bool = False  # radix hit counts (selective policy) count a request once
    load_stats: LoadStats = field(default_factory=LoadStats)  # its loads from L2/L3
    # accounting (set when first scheduled; a preempted request keeps its first numbers)
    num_cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    store_cached_tokens: int = 0  # of the disk tier's, those a networked store (--kv-store) served
    prefill_worker_cached_tokens: int = 0  # of the disk tier's, those a prefill worker sent (pd.py)
    num_recomputed_tokens: int = 0  # tokens recomputed after preemption
    num_replayed_tokens: int = 0  # prompt tokens of the prefix hit recomputed for sliding-window layers
    ring: RingState | None = None  # sliding-window ring (kv/window/)
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # where the output is in its structured-output grammar
    cumulative_logprob: float = 0.0  # of the sampled tokens (best_of ranks samples by it)
    group: SampleGroup | None = None  # the n/best_of samples this sequence is one of
    sample_index: int = 0  # its place in ``group`` (0: the request that ran the prefill)
    spec: SpecCounters = field(default_factory=SpecCounters)  # speculative decoding (spec/)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus the pending ones: what the scheduler has to compute up to."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def awaiting_fork(self) -> bool:
        """Its prompt is about to give its first logits, which all its samples share."""
        return (self.params.num_samples > 1 and self.group is None
                and self.num_computed_tokens >= self.num_prompt_tokens)


@dataclass(eq=False)
class SampleGroup:
    """The sequences of one request with ``n``/``best_of`` > 1. They fork from the request
    once its prompt is prefilled, sharing its KV pages (see ``KVCacheManager.fork``)."""

    request_id: str
    members: list[Request]

    @property
    def is_finished(self) -> bool:
        return all(m.is_finished for m in self.members)

    def chosen(self) -> list[Request]:
        """The ``n`` samples to return: all of them, or the ``n`` of highest cumulative
        log-probability among ``best_of`` (ties keep sample order)."""
        n = self.members[0].params.n
        if len(self.members) == n:
            return list(self.members)
        ranked = sorted(self.members, key=lambda m: -m.cumulative_logprob)
        return ranked[:n]
