"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes cost one token, unfinished prefills continue
with the next chunk), then waiting requests in arrival order while budget, sequence slots
and pages last. A waiting request starts from its longest cached prefix. When pages run
out, the cache evicts unlocked prefixes; if that is not enough, the most recently started
request is preempted (its pages released, its tokens recomputed later — mostly from the
cache it just filled) and put back at the head of the queue, so no request starves.

A request whose cached prefix lies partly in the lower tiers (host memory, disk) starts loading
it when queued; while that load runs it stays in the queue and the requests behind it are
scheduled, so a slow load never stalls the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .kv.cache_manager import KVCacheManager
from .request import Request, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]]  # (request, tokens computed this step)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # one sequence's prefill chunk: capped for sliding-window rings (kv/window/)
        self.max_chunk = kv.max_chunk_tokens or config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.kv.prefetch(req)  # loads from L2/L3 start now, overlapping with compute

    def add_fork(self, req: Request, running: bool) -> None:
        """A sample forked from a running request: running if it got its KV pages, else at
        the head of the queue (it recomputes its prompt's tail from the cache)."""
        if running:
            req.status = Status.RUNNING
            self.running.append(req)
        else:
            self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.max_chunk)
            while not self.kv.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                items.append((req, n))
                budget -= n
                i += 1
                continue
            # ``req`` itself was preempted; the loop index now points past the end
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[w]
            # a request with n/best_of > 1 forks into that many sequences after its prefill
            width = req.params.num_samples if req.group is None else 1
            if len(self.running) + width > self.config.max_num_seqs:
                break
            if self.kv.prefetch(req):  # its KV is still being loaded: schedule the next one
                w += 1
                continue
            self.kv.match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.max_chunk)
            if not self.kv.allocate(req, n):
                self.kv.release(req)
                break
            del self.waiting[w]
            req.status = Status.RUNNING
            self.running.append(req)
            items.append((req, n))
            budget -= n
        return ScheduledBatch(items)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req)
        self.kv.stats.preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and free its pages (its full pages stay in the tree)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
