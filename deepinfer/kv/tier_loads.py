"""``KVCacheManager``'s loads from the lower tiers: a request's cached prefix that only L2/L3
hold, brought back into L1 pages reserved for it, then adopted by the tree.

``prefetch`` (when the request is queued) plans and starts the load; the scheduler leaves the
request waiting while it runs, and ``match_prefix`` applies the finished load (``_apply_load``:
its pages, filled in place by the loaders, adopted by the tree; no copy). A layer-wise load
(``stream_layers``, ``tiers/layer_stream.py``) instead lets the request start at once: its pages
are the request's own while its prefill waits per layer, and ``cache_pages`` ends it
(``_end_stream``): the pages that checked out go to the tree, and a request whose pages did not
is rewound to the first bad one and recomputes the rest.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ..request import Request
from .cache_stats import CacheStats
from .radix import DEVICE, DISK, NUM_TIERS, TIER_NAMES, RadixTree
from .tiers.backend import LoadJob
from .tiers.page_store import LOCAL

if TYPE_CHECKING:
    from .pool import PageAllocator
    from .tiers.policy import TierManager


class TierLoads:
    """Mixin of ``KVCacheManager`` (which sets these fields and ``_lookup_hashes``)."""

    allocator: PageAllocator
    page_size: int
    tree: RadixTree | None
    tiers: TierManager | None
    stats: CacheStats
    max_loads: int  # loads started and not yet applied (bounds staged data)
    stream_layers: bool
    _jobs: set[LoadJob]
    _orphans: list[LoadJob]  # loads of requests that went away, still running
    _load_pages: int  # L1 pages held by loads not yet applied (at most half the pool)

    if TYPE_CHECKING:
        def _lookup_hashes(self, req: Request) -> list[bytes]: ...

    def prefetch(self, req: Request) -> bool:
        """Start loading the part of ``req``'s cached prefix that only L2/L3 hold.

        Called when the request is queued and again by the scheduler while it waits. Returns
        True while the request must wait (its load is running, or too many loads are).
        """
        if self.tiers is None:
            return False
        if req.kv_load is not None:  # a layer-wise load may start its request at once
            return not req.kv_load.done and req.kv_load.layers is None
        if req.kv_prefetched:
            return False
        return self._start_load(req, force=False)

    def _start_load(self, req: Request, force: bool) -> bool:
        assert self.tiers is not None and self.tree is not None
        hashes = self._lookup_hashes(req)
        m = self.tree.match(hashes, count_hit=not req.kv_hit_counted)
        req.kv_hit_counted = True
        self.tiers.after_hit(m.path)
        job = self.tiers.plan(hashes, m.path, req.all_token_ids)
        if job is None:
            req.kv_prefetched = True
            return False
        busy = len(self._jobs) >= self.max_loads or self._load_pages >= self.allocator.num_pages // 2
        if busy and not force:
            return True
        req.kv_prefetched = True
        if self.stream_layers:  # (before the pages are reserved: it may cut the probe)
            self.tiers.backend.stream_layers(job)
        self.tree.lock(job.locked)  # keeps the L1 prefix and the L2 slots being read in place
        need = len(job.sources) + len(job.probe)
        self.ensure_free(need)
        n = min(need, self.allocator.num_free)  # L1 full of locked pages: load what fits
        if n == 0:
            self.tree.unlock(job.locked)
            return False
        job.truncate(n)
        job.dest = self.allocator.alloc(n)
        self._load_pages += n
        self._jobs.add(job)
        req.kv_load = job
        self.tiers.backend.start_load(job)
        return not job.done and job.layers is None

    def loads_in_flight(self) -> bool:
        return any(not j.done for j in self._jobs) or bool(self._orphans)

    def wait_for_loads(self, timeout: float) -> None:
        if self.tiers is not None:
            self.tiers.backend.wait(timeout)

    def _drop_job(self, job: LoadJob) -> None:
        """Forget a finished load: its L1 pages not adopted go back to the allocator."""
        assert self.tiers is not None and self.tree is not None
        self.allocator.free(job.dest)
        self._load_pages -= len(job.dest)
        job.dest = []
        self.tree.unlock(job.locked)
        self._jobs.discard(job)

    def _streams(self, req: Request) -> bool:
        """Admit ``req`` while its layer-wise load runs (its prefill waits per layer)?"""
        job = req.kv_load
        assert job is not None and self.tree is not None
        if job.layers is None or job.done:
            return False
        m = self.tree.match(self._lookup_hashes(req), touch=False, count_hit=False)
        return sum(n.num_pages for n in m.path if n.tiers[DEVICE] is not None) == job.start

    def _end_stream(self, req: Request) -> LoadJob:
        """After the forward that ran on a layer-wise load: wait for its end, and rewind the
        request to the first page that did not check out (``kv_rewound``: that step's token is
        dropped and the rest recomputed; nothing of those pages reached the tree)."""
        assert self.tiers is not None and req.kv_load is not None
        job, req.kv_load = req.kv_load, None
        while not job.done:
            self.tiers.backend.wait(0.05)
        n, lost = job.num_loaded, len(job.dest) - job.num_loaded
        self._load_pages -= len(job.dest)
        job.dest = []  # the pages stay the request's (the tree adopts the good ones)
        self.tiers.backend.finish_load(job, n)
        self.stats.streamed_loads += 1
        if lost:
            self.stats.streamed_rewinds += 1
            req.kv_rewound = True
            good = (job.start + n) * self.page_size
            req.num_computed_tokens = min(req.num_computed_tokens, good)
            # the hit counted at admission shrinks to the pages that checked out
            lost_tokens = max(0, min(lost * self.page_size, (req.num_cached_tokens or 0) - good))
            req.num_cached_tokens = (req.num_cached_tokens or 0) - lost_tokens
            req.cached_tokens_by_tier[TIER_NAMES[DISK]] -= lost_tokens
            self.stats.hit_tokens -= lost_tokens
            self.stats.hit_tokens_by_tier[TIER_NAMES[DISK]] -= lost_tokens
        self._account_load(req, job)
        return job

    def take_rewound(self, req: Request) -> bool:
        """Whether ``req``'s last step ran on pages that failed their check (and clear it)."""
        was, req.kv_rewound = req.kv_rewound, False
        return was

    def _apply_load(self, req: Request) -> tuple[list[int], Counter[str]]:
        """Adopt a finished load's pages (already in L1) into the tree; returns pages adopted
        per source tier, and per origin (``tiers/page_store.py``)."""
        assert self.tiers is not None and self.tree is not None
        job = req.kv_load
        assert job is not None and job.done
        req.kv_load = None
        adopted = [0] * NUM_TIERS
        origins: Counter[str] = Counter()
        n = job.num_loaded
        if n:
            pages, job.dest = job.dest[:n], job.dest[n:]  # the rest is freed with the job
            self._load_pages -= n
            self.tiers.backend.finish_load(job, n)
            end = job.start + n
            tokens = req.all_token_ids
            m, kept = self.tree.insert(req.page_hashes[:end], tokens[: end * self.page_size],
                                       DEVICE, job.prefix_pages + pages)
            for i, p in enumerate(pages):
                if kept[job.start + i] == p:
                    adopted[job.page_tiers[i]] += 1
                    origins[job.page_origins[i] if i < len(job.page_origins) else LOCAL] += 1
                else:  # someone brought this page back meanwhile: keep theirs
                    self.allocator.free([p])
            if job.probe:
                self.tiers.adopted_disk_records(m.path, job, end)
            self.tiers.after_insert(m.path)
        self._drop_job(job)
        self._account_load(req, job)
        return adopted, origins

    def _account_load(self, req: Request, job: LoadJob) -> None:
        s, n = self.stats, job.num_loaded
        s.loads += 1
        s.loaded_pages += n
        s.load_seconds += job.seconds
        s.load_seconds_max = max(s.load_seconds_max, job.seconds)
        s.load.add(job)
        req.load_stats.add(job)
        if job.failed_at is not None:
            s.load_failures += 1
            if job.failed_at < len(job.sources) and job.sources[job.failed_at][0] == DISK:
                self.tiers.forget_disk(job.source_nodes[job.failed_at])

