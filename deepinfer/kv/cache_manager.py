"""The scheduler's view of the KV cache: prefix matching, page allocation, caching, release.

It owns the radix tree and the page allocator but no tensors, so the capacity planner can
drive the very same code with no model. Ownership rule: the leading ``req.num_tree_pages``
pages of a request belong to the tree (the request holds a lock on the deepest of them);
the rest are the request's own and are freed when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request import Request
from .hashing import chain_hashes, root_hash
from .pool import PageAllocator
from .radix import DEVICE, TIER_NAMES, Node, RadixTree


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # of which served from cache (vLLM's prefix_cache_hits)
    evicted_pages: int = 0
    preemptions: int = 0


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, page_size: int, model_identity: str,
                 enable_prefix_cache: bool = True, max_node_pages: int = 64) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.model_identity = model_identity
        self.tree = RadixTree(page_size, max_node_pages) if enable_prefix_cache else None
        self.stats = CacheStats()
        self._roots: dict[str | None, bytes] = {}

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

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, req: Request) -> int:
        """Attach the longest cached prefix to a request about to start; returns its tokens.

        At least one token is always left to compute (its logits start the generation).
        """
        first = req.num_cached_tokens is None
        if first:
            self.stats.query_tokens += req.num_prompt_tokens
        matched = 0
        if self.tree is not None:
            tokens = req.all_token_ids
            self.update_hashes(req, tokens)
            max_pages = (len(tokens) - 1) // self.page_size
            m = self.tree.match(req.page_hashes[:max_pages])
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
            req.pages = pages
            req.num_tree_pages = len(pages)
            matched = len(pages) * self.page_size
        req.num_computed_tokens = matched
        if first:
            req.num_cached_tokens = min(matched, req.num_prompt_tokens)
            req.cached_tokens_by_tier = {TIER_NAMES[DEVICE]: req.num_cached_tokens}
            self.stats.hit_tokens += req.num_cached_tokens
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

    def ensure_free(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.stats.evicted_pages += self.tree.evict(DEVICE, short, self._release)
        return self.allocator.num_free >= n

    def _release(self, node: Node, tier: int) -> None:
        if tier == DEVICE:
            self.allocator.free(node.tiers[DEVICE])

    # ------------------------------------------------------------------ caching
    def cache_pages(self, req: Request) -> None:
        """Hand every newly filled page of ``req`` to the tree, so other requests can hit it."""
        if self.tree is None:
            return
        full = req.num_computed_tokens // self.page_size
        if full <= req.num_tree_pages:
            return
        tokens = req.all_token_ids
        self.update_hashes(req, tokens[: full * self.page_size])
        m, kept = self.tree.insert(req.page_hashes[:full], tokens[: full * self.page_size],
                                   DEVICE, req.pages[:full])
        for i in range(req.num_tree_pages, full):
            if kept[i] != req.pages[i]:  # the tree already had this page: drop our copy
                self.allocator.free([req.pages[i]])
                req.pages[i] = kept[i]
        self.tree.lock(m.last)
        self.tree.unlock(req.locked_node)
        req.locked_node = m.last
        req.num_tree_pages = full

    def release(self, req: Request) -> None:
        """Give back a finished, aborted or preempted request's pages (tree pages stay cached)."""
        if self.tree is not None:
            self.tree.unlock(req.locked_node)
        self.allocator.free(req.pages[req.num_tree_pages :])
        req.locked_node = None
        req.pages = []
        req.num_tree_pages = 0
        req.num_computed_tokens = 0

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free
