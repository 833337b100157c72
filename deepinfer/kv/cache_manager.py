"""The scheduler's view of the KV cache: prefix matching, page allocation, caching, release.

It owns the radix tree, the page allocator and (optionally) the lower tiers' ``TierManager``
but no tensors, so the capacity planner can drive the very same code with no model (the tiers'
data moves through a ``TierBackend``: ``TierIO`` in the engine, ``CountingBackend`` in the
planner). Built by ``build.py``; models with sliding-window layers get the subclass in
``window/manager.py``. Ownership rule: the leading ``req.num_tree_pages`` pages of a request belong to
the tree (the request holds a lock on the deepest of them); the rest are the request's own and
are freed when it ends.

With lower tiers, a request's cached prefix may lie partly in L2/L3. ``prefetch`` (called when
the request is queued) plans and starts loading those pages; the scheduler leaves the request
waiting while ``prefetch`` says so and schedules others. ``match_prefix`` then applies the
finished load (its L1 pages, reserved by ``prefetch`` and filled by the loaders, adopted by
the tree; no copy) before the usual L1 match. A page that cannot be loaded (bad checksum, file gone) ends the load there: the
request computes the rest, and the miss is counted.

Shared prefixes in flight are computed once: a running request's prompt pages that are not in
the tree yet are registered as *being computed* (page hash -> request). A waiting request
whose next uncached page is one of them waits (``joins_computing``) until the tree has it,
instead of computing the same KV a second time; a request sharing nothing never waits.
"""

from __future__ import annotations

from collections import Counter

from ..request import Request
from .hashing import chain_hashes, root_hash
from .pool import PageAllocator
from .radix import DEVICE, DISK, HOST, NUM_TIERS, TIER_NAMES, Node, RadixTree
from .cache_stats import CacheStats
from .tier_loads import TierLoads
from .tiers.backend import LoadJob, TierBackend
from .tiers.page_store import PREFILL_WORKER, STORE
from .tiers.policy import TierManager, TierPolicy


class KVCacheManager(TierLoads):
    max_chunk_tokens: int | None = None  # cap on one sequence's prefill chunk (None: none)

    def __init__(self, allocator: PageAllocator, page_size: int, model_identity: str,
                 enable_prefix_cache: bool = True, max_node_pages: int = 64,
                 tiers: TierBackend | None = None, policy: TierPolicy | None = None,
                 max_loads: int = 64, stream_layers: bool = False) -> None:
        """``stream_layers``: L3 hits load layer by layer, their prefill waiting per layer
        (``tiers/layer_stream.py``); not with overlap scheduling or speculative decoding,
        whose next step is planned before a rewind could happen."""
        self.allocator = allocator
        self.stream_layers = stream_layers
        self.page_size = page_size
        self.model_identity = model_identity
        self.tree = RadixTree(page_size, max_node_pages) if enable_prefix_cache else None
        self.stats = CacheStats()
        self._roots: dict[str | None, bytes] = {}
        self.tiers: TierManager | None = None
        if tiers is not None and self.tree is not None and (tiers.host_capacity or tiers.disk_capacity):
            self.tiers = TierManager(self.tree, tiers, policy or TierPolicy(), self.allocator.free)
        self.max_loads = max_loads  # loads started and not yet applied (bounds staged data)
        self._jobs: set[LoadJob] = set()
        self._orphans: list[LoadJob] = []  # loads of requests that went away, still running
        self._load_pages = 0  # L1 pages held by loads not yet applied (at most half the pool)
        self._computing: dict[bytes, Request] = {}  # page hash -> the running request computing it

    # ------------------------------------------------------------------ hashing
    def root(self, salt: str | None) -> bytes:
        if salt not in self._roots:
            self._roots[salt] = root_hash(self.model_identity, salt)
        return self._roots[salt]

    def update_hashes(self, req: Request, tokens: list[int] | None = None) -> None:
        """Extend ``req.page_hashes`` to every full page of its tokens."""
        tokens = req.all_token_ids if tokens is None else tokens
        if len(tokens) // self.page_size > len(req.page_hashes):
            parent = req.page_hashes[-1] if req.page_hashes else self.root(req.cache_salt)
            req.page_hashes += chain_hashes(tokens, self.page_size, parent, len(req.page_hashes))

    def _lookup_hashes(self, req: Request) -> list[bytes]:
        """Page hashes a lookup may use: at least one token is always left to compute."""
        tokens = req.all_token_ids
        self.update_hashes(req, tokens)
        return req.page_hashes[: (len(tokens) - 1) // self.page_size]

    # ------------------------------------------------------------------ housekeeping
    def poll(self) -> None:
        """Main-thread housekeeping (each step): forget failed L3 writes, drop loads nobody
        wants, finish promotions (and end an idle period)."""
        if self.tiers is None:
            return
        self.tiers.poll()
        if self.tiers.promoter is not None:
            self.tiers.promoter.end_idle()
        if self._orphans:
            done = [j for j in self._orphans if j.done]
            self._orphans = [j for j in self._orphans if not j.done]
            for job in done:
                self._drop_job(job)

    # ------------------------------------------------------------------ shared prefixes in flight
    def joins_computing(self, req: Request) -> bool:
        """True while the first page of ``req``'s prompt that the tree lacks is being computed
        by another running request: ``req`` then waits for it rather than computing it again."""
        if self.tree is None or not self._computing:
            return False
        hashes = self._lookup_hashes(req)
        k = self.tree.match(hashes, touch=False, count_hit=False).num_pages
        return k < len(hashes) and self._computing.get(hashes[k], req) is not req

    def _register_computing(self, req: Request) -> None:
        """At admission: the prompt pages ``req`` will compute become joinable."""
        if self.tree is None:
            return
        for h in self._lookup_hashes(req)[req.num_tree_pages :]:
            self._computing.setdefault(h, req)

    def _unregister_computing(self, req: Request, hashes: list[bytes]) -> None:
        for h in hashes:
            if self._computing.get(h) is req:
                del self._computing[h]

    def evict(self, tier: int = DEVICE, num_pages: int | None = None) -> int:
        """Evict (demote, per the tier policy) up to ``num_pages`` unlocked pages of ``tier``
        (all of them by default). For tests, benchmarks and operations."""
        if self.tree is None:
            return 0
        n = self.tree.pages_in_tier[tier] if num_pages is None else num_pages
        dropped = self.tree.evict(tier, n, self._release)
        if tier == DEVICE:
            self.stats.evicted_pages += dropped
        return dropped

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, req: Request) -> int:
        """Attach the longest cached prefix to a request about to start; returns its tokens.

        At least one token is always left to compute (its logits start the generation).
        A finished lower-tier load is applied first (a synchronous caller, e.g. the planner,
        gets its load started and waited for here).
        """
        first = req.num_cached_tokens is None
        if first:
            self.stats.query_tokens += req.num_prompt_tokens
        matched = 0
        adopted, origins = [0] * NUM_TIERS, Counter[str]()
        if self.tree is not None:
            if self.tiers is not None:
                if req.kv_load is None and not req.kv_prefetched:
                    self._start_load(req, force=True)
                if req.kv_load is not None and not self._streams(req):
                    while not req.kv_load.done:
                        self.tiers.backend.wait(0.05)
                    adopted, origins = self._apply_load(req)
            hashes = self._lookup_hashes(req)
            m = self.tree.match(hashes, count_hit=not req.kv_hit_counted)
            req.kv_hit_counted = True
            pages: list[int] = []
            last: Node | None = None
            for node in m.path:
                if node.tiers[DEVICE] is None:
                    break
                pages += node.tiers[DEVICE]
                last = node
            if last is not None:
                self.tree.lock(last)
            req.locked_node = last
            req.num_tree_pages = len(pages)
            if req.kv_load is not None:  # a layer-wise load: its pages are the request's for now
                assert req.kv_load.start == len(pages)
                pages = pages + req.kv_load.dest
                adopted[DISK] = len(req.kv_load.dest)
            req.pages = pages
            matched = len(pages) * self.page_size
        req.kv_prefetched = False
        req.num_computed_tokens = matched
        self._register_computing(req)
        if first:
            req.num_cached_tokens = min(matched, req.num_prompt_tokens)
            by_tier = {TIER_NAMES[DEVICE]: req.num_cached_tokens}
            if self.tiers is not None:
                host, disk = adopted[HOST] * self.page_size, adopted[DISK] * self.page_size
                by_tier = {TIER_NAMES[DEVICE]: req.num_cached_tokens - host - disk,
                           TIER_NAMES[HOST]: host, TIER_NAMES[DISK]: disk}
            req.cached_tokens_by_tier = by_tier
            req.store_cached_tokens = origins[STORE] * self.page_size  # (part of the disk tier's)
            req.prefill_worker_cached_tokens = origins[PREFILL_WORKER] * self.page_size
            self.stats.hit_tokens += req.num_cached_tokens
            for t, v in by_tier.items():
                self.stats.hit_tokens_by_tier[t] += v
        else:
            req.num_recomputed_tokens += req.num_tokens - matched
        return matched

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; False if the pool is full."""
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if not self.ensure_free(need):
            return False
        req.pages += self.allocator.alloc(need)
        return True

    def rollback(self, req: Request, num_new_tokens: int = 0) -> int:
        """Free ``req``'s pages past its computed tokens plus ``num_new_tokens`` (KV written
        beyond what the request kept: rejected draft tokens, an SPS profile's dummy span), so it
        holds the pages a plain step would leave it. The tree's pages are never touched (they
        end at the computed tokens). Returns the pages freed."""
        keep = max(req.num_tree_pages,
                   -(-(req.num_computed_tokens + num_new_tokens) // self.page_size))
        extra = req.pages[keep:]
        if extra:
            del req.pages[keep:]
            self.allocator.free(extra)
        return len(extra)

    def ensure_free(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.stats.evicted_pages += self.tree.evict(DEVICE, short, self._release)
        return self.allocator.num_free >= n

    def _release(self, node: Node, tier: int) -> None:
        """The tree's eviction callback: demote per the tier policy, or free L1 pages."""
        if self.tiers is not None:
            self.tiers.release(node, tier)  # frees the L1 pages itself once copied
        elif tier == DEVICE:
            self.allocator.free(node.tiers[DEVICE])

    # ------------------------------------------------------------------ caching
    def cache_pages(self, req: Request, num_tokens: int | None = None) -> None:
        """Hand every newly filled page of ``req`` to the tree, so other requests can hit it.
        ``num_tokens``: how many tokens' KV is written (default all computed; fewer while a
        step in flight still writes the rest, see ``overlap.py``)."""
        if self.tree is None:
            return
        streamed = self._end_stream(req) if req.kv_load is not None else None
        full = (req.num_computed_tokens if num_tokens is None else num_tokens) // self.page_size
        if full <= req.num_tree_pages:
            if streamed is not None:
                self._drop_job(streamed)
            return
        ps, own = self.page_size, req.num_tree_pages
        tokens = req.all_token_ids
        self.update_hashes(req, tokens[: full * ps])
        # only the new pages: the request's first ``own`` pages are the tree's, below its lock
        m, kept = self.tree.insert(req.page_hashes[own:full], tokens[own * ps : full * ps],
                                   DEVICE, req.pages[own:full], below=req.locked_node)
        for i, page in enumerate(kept, start=own):
            if page != req.pages[i]:  # the tree already had this page: drop our copy
                self.allocator.free([req.pages[i]])
                req.pages[i] = page
        self.tree.lock(m.last)
        self.tree.unlock(req.locked_node)
        req.locked_node = m.last
        self._unregister_computing(req, req.page_hashes[own:full])
        req.num_tree_pages = full
        if streamed is not None:  # L3 records of the probed pages, then drop the job's lock
            assert self.tiers is not None
            if streamed.probe:
                path = self.tree.match(req.page_hashes[:full], touch=False, count_hit=False).path
                self.tiers.adopted_disk_records(path, streamed, streamed.start + streamed.num_loaded)
            self._drop_job(streamed)
        if self.tiers is not None:
            self.tiers.after_insert(m.path)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give ``child`` ``parent``'s KV: the tree's pages shared (one more lock on them),
        the parent's own pages (the partial last page; every page without a prefix cache)
        copied to new pages. Returns the (source, destination) page copies for the runner,
        or None when the pool has no room (the child then recomputes from the cache)."""
        shared, own = parent.num_tree_pages, parent.pages[parent.num_tree_pages :]
        if not self.ensure_free(len(own)):
            return None
        new = self.allocator.alloc(len(own))
        child.pages = parent.pages[:shared] + new
        child.num_tree_pages = shared
        child.locked_node = parent.locked_node
        if self.tree is not None:
            self.tree.lock(parent.locked_node)
        child.page_hashes = list(parent.page_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        return list(zip(own, new))

    def on_idle(self) -> bool:
        """The engine has nothing to run: promote recent conversations' L3 pages to L2
        (``tiers/promotion.py``); True while promotions are in flight (call again soon)."""
        if self.tiers is None or self.tiers.promoter is None:
            return False
        return self.tiers.promoter.on_idle()

    def release(self, req: Request) -> None:
        """Give back a finished, aborted or preempted request's pages (tree pages stay cached)."""
        if self.tiers is not None and self.tiers.promoter is not None:
            self.tiers.promoter.remember(req.page_hashes[: req.num_tree_pages])
        if self.tree is not None:
            self.tree.unlock(req.locked_node)
            self._unregister_computing(req, req.page_hashes[req.num_tree_pages :])
        if req.kv_load is not None:  # still loading (or loaded, not applied): nobody wants it
            job, req.kv_load = req.kv_load, None
            job.cancelled = True
            own = set(job.dest)  # a layer-wise load's pages: freed with the job, once it ends
            req.pages = [p for i, p in enumerate(req.pages) if i < req.num_tree_pages or p not in own]
            if job.done:
                self._drop_job(job)
            else:
                self._orphans.append(job)
        req.kv_prefetched = False
        self.allocator.free(req.pages[req.num_tree_pages :])
        req.locked_node = None
        req.pages = []
        req.num_tree_pages = 0
        req.num_computed_tokens = 0

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    def window_stats(self) -> dict[str, int]:
        """Sliding-window counters and gauges (none without a window group)."""
        return {}

    def tier_stats(self) -> dict:
        """Per-tier counters for ``LLMEngine.stats()`` (empty without lower tiers)."""
        if self.tiers is None:
            return {}
        return {**self.tiers.stats(), "backend": self.tiers.backend.stats()}
