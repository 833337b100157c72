"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes cost one token, unfinished prefills continue
with the next chunk), then waiting requests in arrival order while budget, sequence slots
and pages last. A waiting request starts from its longest cached prefix. When pages run
out, the cache evicts unlocked prefixes; if that is not enough, the most recently started
request is preempted (its pages released, its tokens recomputed later — mostly from the
cache it just filled) and put back at the head of the queue, so no request starves.

A request whose cached prefix lies partly in the lower tiers (host memory, disk) starts loading
it when queued; while that load runs it stays in the queue and the requests behind it are
scheduled, so a slow load never stalls the others. Likewise a request whose next uncached
pages another running request is computing right now (batch questions over one document)
waits for them instead of computing them twice.

Fault isolation: an exception while scheduling one request (hashing its pages, matching or
loading its prefix, allocating its pages) fails that request alone. ``fail`` takes it out of
every queue, frees its pages and keeps it in ``failed`` for the engine to report; the other
requests are scheduled as if it had never been there.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from .config import EngineConfig
from .kv.cache_manager import KVCacheManager
from .request import Request, Status

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]]  # (request, tokens computed this step)
    blocked: bool = False  # a running request needs pages that only a preemption would free

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
        self.failed: list[Request] = []  # ended by an exception in their own work, not yet reported

    def add(self, req: Request) -> None:
        """Queue ``req``; if looking up its cached prefix raises, it is not queued and it raises."""
        self.waiting.append(req)
        try:
            self.kv.prefetch(req)  # loads from L2/L3 start now, overlapping with compute
        except Exception:
            self.finish(req, "error")
            raise

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

    def schedule(self, preempt: bool = True) -> ScheduledBatch:
        """The next step's items. ``preempt=False`` (overlap: a step in flight may still write
        a victim's pages and owes it a token): stop at ``blocked`` instead of preempting."""
        budget = self.config.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_scheduled_tokens - req.num_computed_tokens, budget, self.max_chunk)
            fits = self._fit_running(req, n, preempt)
            if fits is None:
                return ScheduledBatch(items, blocked=True)
            if fits:
                items.append((req, n))
                budget -= n
                i += 1
            # else ``req`` was preempted or failed: index i now holds the next request
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[w]
            # a request with n/best_of > 1 forks into that many sequences after its prefill
            width = req.params.num_samples if req.group is None else 1
            if len(self.running) + width > self.config.max_num_seqs:
                break
            try:
                # its KV is still being loaded, or another request is computing its next
                # pages: schedule the next one
                if self.kv.prefetch(req) or self.kv.joins_computing(req):
                    w += 1
                    continue
                self.kv.match_prefix(req)
                n = min(req.num_tokens - req.num_computed_tokens, budget, self.max_chunk)
                if not self.kv.allocate(req, n):
                    self.kv.release(req)
                    if self.running or items:
                        break  # pages come back as those requests finish: keep the order
                    # nothing runs to give pages back: the pages this request lacks may be
                    # held by later requests' finished loads, adopted only when they are
                    # reached, so stopping here would wait forever
                    w += 1
                    continue
            except Exception as e:  # noqa: BLE001 - this request's fault: the others go on
                self.fail(req, e)  # out of ``waiting``: index w now holds the next request
                continue
            del self.waiting[w]
            req.status = Status.RUNNING
            self.running.append(req)
            items.append((req, n))
            budget -= n
        return ScheduledBatch(items)

    def _fit_running(self, req: Request, n: int, preempt: bool) -> bool | None:
        """Allocate ``n`` slots for running ``req``, preempting the newest requests while pages
        run out. False if ``req`` itself got preempted or failed; None if it needs a preemption
        that ``preempt=False`` forbids."""
        while True:
            try:
                if self.kv.allocate(req, n):
                    return True
            except Exception as e:  # noqa: BLE001
                self.fail(req, e)
                return False
            if not preempt:
                return None
            victim = self.running[-1]
            try:
                self._preempt(victim)
            except Exception as e:  # noqa: BLE001
                self.fail(victim, e)
            if victim is req:
                return False

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req)
        self.kv.stats.preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and free its pages (its full pages stay in the tree). It is out
        of every queue even if freeing its pages raises."""
        if req.status is Status.RUNNING and req in self.running:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.kv.release(req)

    def fail(self, req: Request, error: BaseException) -> None:
        """End ``req`` (finish reason ``error``) after an exception in its own work."""
        if req.is_finished and req.finish_reason == "error":
            return
        req.error = f"{type(error).__name__}: {error}"
        self.failed.append(req)
        try:
            self.finish(req, "error")
        except Exception:  # noqa: BLE001 - its pages may stay allocated; it is out of the queues
            log.exception("freeing the pages of failed request %s failed", req.request_id)

    def take_failed(self) -> list[Request]:
        out, self.failed = self.failed, []
        return out
