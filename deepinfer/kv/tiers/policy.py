"""Tier policy: where cached KV pages live (L1 device, L2 host DRAM, L3 disk) and when they move.

Model-free and tensor-free, like the radix tree: this module decides and keeps the capacity
accounting on the tree; the bytes move through a ``TierBackend`` (``backend.py``): the engine's
is ``TierIO`` (codecs, pinned host slots, files, background threads), the capacity planner's and
the policy tests' ``CountingBackend``, which moves nothing and only counts.

Placement (``TierPolicy.mode``):

* ``write_back``: pages move down only when evicted: L1 -> L2 (or straight to L3 without L2),
  L2 -> L3. Nothing reaches the disk until the host tier overflows.
* ``write_through`` (default): every page the tree adopts from a request is also written to L3
  at once (in the background), so a restarted engine, or another one sharing the directory,
  finds it. L1 evictions still go to L2; L2 evictions only drop (the page is on L3), except
  when the write-through was dropped or failed, then they write back.
* ``selective``: like ``write_back`` but L3 only takes nodes with at least ``selective_hits``
  lookups; such a node is written through as soon as it reaches that count. Cold prefixes
  never cost disk bandwidth.

Whole radix nodes move (a node is a run of pages that travel together). An L1 eviction that
demotes a node to L2 first makes room there (evicting L2's LRU leaves, which may write them to
L3), all under the node's lock, so the nested evictions can never remove the node or its
ancestors. The tree's L3 records are an index bounded to the store's capacity; the files are
bounded by the store's own LRU, and a record whose file turns out to be gone is forgotten
(``forget_disk``) when a load or a write reports it.

Loads: ``plan`` turns a prefix match into a ``LoadJob``: the pages after the L1-resident part
that L2 or L3 hold (per page: tier and slot or key), then the L3 keys of the following pages
(``probe``), which a fresh process finds by chained page hash with an empty tree. The backend
fills the job (in the background for the engine); the cache manager then allocates L1 pages,
has the backend copy the data in and inserts the pages into the tree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...log_limit import RateLimitedLog
from ..radix import DEVICE, DISK, HOST, NUM_TIERS, TIER_NAMES, Node, RadixTree
from .backend import LoadJob, PageSource, TierBackend
from .disk_file import PageId, page_id
from .promotion import IdlePromoter

log = logging.getLogger(__name__)

WRITE_THROUGH, WRITE_BACK, SELECTIVE = "write_through", "write_back", "selective"
POLICIES = (WRITE_THROUGH, WRITE_BACK, SELECTIVE)


@dataclass
class TierPolicy:
    mode: str = WRITE_THROUGH
    selective_hits: int = 2
    # idle-time L3 -> L2 promotion of recent conversations (``promotion.py``): bytes per idle
    # period, 0 = off; also at most a quarter of L2's pages per period
    idle_promote_bytes: int = 0

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        if self.selective_hits < 1:
            raise ValueError(f"selective_hits must be >= 1, got {self.selective_hits}")
        if self.idle_promote_bytes < 0:
            raise ValueError(f"idle_promote_bytes must be >= 0, got {self.idle_promote_bytes}")

    def write_through(self, node: Node) -> bool:
        """Write this node to L3 now (just adopted by the tree, or just hit)?"""
        if self.mode == WRITE_THROUGH:
            return True
        return self.mode == SELECTIVE and node.hits >= self.selective_hits

    def demote_to_disk(self, node: Node) -> bool:
        """Keep this node on L3 when the tier above evicts it (and it is not there yet)?"""
        return self.mode != SELECTIVE or node.hits >= self.selective_hits


class TierManager:
    """The tiers' side of the cache manager: what happens to a node when a tier drops it,
    write-through, load plans and applying their results to the tree. No tensors."""

    def __init__(self, tree: RadixTree, backend: TierBackend, policy: TierPolicy,
                 free_device_pages: Callable[[list[int]], None]) -> None:
        self.tree = tree
        self.backend = backend
        self.policy = policy
        self._free_device = free_device_pages
        self.capacity = [0, backend.host_capacity, backend.disk_capacity]
        self.evicted = [0] * NUM_TIERS  # pages dropped per tier (demoted or gone)
        self.stale_disk_records = 0
        self.skipped_too_large = 0  # pages of nodes larger than the whole L3 bound, not written
        self.skipped_no_room = 0  # pages not written: the L3 pages the tree records are all locked
        self._log = RateLimitedLog(log)
        self._disk_nodes: dict[str, Node] = {}  # L3 key -> node recording it (to forget failed writes)
        self.promoter: IdlePromoter | None = None
        if policy.idle_promote_bytes and self.has_host and self.has_disk:
            self.promoter = IdlePromoter(tree, backend, backend.host_page_nbytes,
                                         policy.idle_promote_bytes, self.capacity[HOST] // 4,
                                         self._room_older, self._page_ids)

    @property
    def has_host(self) -> bool:
        return self.capacity[HOST] > 0

    @property
    def has_disk(self) -> bool:
        return self.capacity[DISK] > 0

    # ---------------------------------------------------------------- eviction callback
    def release(self, node: Node, tier: int) -> None:
        """Called by the tree before ``node`` loses ``tier``: demote it a tier down if the
        policy says so (the copy is captured now), then free this tier's resources."""
        values = node.tiers[tier]
        assert values is not None
        self.evicted[tier] += node.num_pages
        attached = self._attached(node)
        if tier == DEVICE:
            if attached:
                self.tree.lock(node)  # nested evictions below must not remove it or its ancestors
                try:
                    if self.has_host and node.tiers[HOST] is None:
                        slots = self._room(HOST, node.num_pages) and self.backend.host_alloc(node.num_pages)
                        if slots:
                            self.backend.device_to_host(values, slots)
                            self.tree.add_tier(node, HOST, slots)
                    if (node.tiers[HOST] is None and node.tiers[DISK] is None and self.has_disk
                            and self.policy.demote_to_disk(node)):
                        self._to_disk(node, values, from_host=False)
                finally:
                    self.tree.unlock(node)
            self._free_device(values)
        elif tier == HOST:
            if attached and node.tiers[DISK] is None and self.has_disk and self.policy.demote_to_disk(node):
                self.tree.lock(node)
                try:
                    self._to_disk(node, values, from_host=True)
                finally:
                    self.tree.unlock(node)
            self.backend.host_free(values)
        else:  # DISK: the tree forgets; the store's own LRU bounds the files
            for k in values:
                self._disk_nodes.pop(k, None)

    def _to_disk(self, node: Node, src: list, from_host: bool) -> bool:
        n = node.num_pages
        if n > self.capacity[DISK]:
            self.skipped_too_large += n
            self._log.warning("too-large", "L3: a node of %d pages is larger than the L3 bound of "
                              "%d pages; not written (raise --disk-cache-gb, or lower "
                              "--max-node-pages)", n, self.capacity[DISK])
            return False
        if not self._room(DISK, n):
            self.skipped_no_room += n
            self._log.warning("no-room", "L3: no room for %d pages (every L3 page is locked); "
                              "not written", n)
            return False
        keys = [self.backend.disk_key(h) for h in node.hashes]
        ids = self._page_ids(node.hashes, node.tokens)
        ok = (self.backend.host_to_disk(src, keys, ids) if from_host
              else self.backend.device_to_disk(src, keys, ids))
        if ok:
            self.tree.add_tier(node, DISK, keys)
            for k in keys:
                self._disk_nodes[k] = node
        return ok

    def _page_ids(self, hashes: list[bytes], tokens: Sequence[int] | None) -> list[PageId]:
        ps = self.tree.page_size
        return [page_id(h, None if tokens is None else tokens[i * ps : (i + 1) * ps])
                for i, h in enumerate(hashes)]

    def _room(self, tier: int, n: int) -> bool:
        """Make ``tier`` able to take ``n`` more pages (evicting its LRU leaves)."""
        cap = self.capacity[tier]
        if n > cap:
            return False
        short = self.tree.pages_in_tier[tier] + n - cap
        if short > 0:
            self.tree.evict(tier, short, self._release_cb)
        return self.tree.pages_in_tier[tier] + n <= cap

    def _room_older(self, n: int, older_than: int) -> bool:
        """Like ``_room`` on L2, for a promotion: first drops the L2 copies of unlocked nodes
        that L1 holds too (nothing is lost: an L1 eviction writes them again; no load is
        reading them, loads lock their path), oldest first, then evicts only nodes last used
        before ``older_than``."""
        short = self.tree.pages_in_tier[HOST] + n - self.capacity[HOST]
        if short > 0:
            stack, copies = [self.tree.root], []
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.lock_ref == 0 and node.tiers[DEVICE] is not None and node.tiers[HOST] is not None:
                    copies.append(node)
            for node in sorted(copies, key=lambda c: c.last_access):
                if short <= 0:
                    break
                self.tree.drop_tier(node, HOST, self._release_cb)
                short -= node.num_pages
        if short > 0:
            self.tree.evict(HOST, short, self._release_cb, older_than=older_than)
        return self.tree.pages_in_tier[HOST] + n <= self.capacity[HOST]

    def _release_cb(self, node: Node, tier: int) -> None:
        self.release(node, tier)

    def _attached(self, node: Node) -> bool:
        """False inside a subtree being dropped (no point demoting what the tree forgets)."""
        while node.parent is not None:
            if node.parent.children.get(node.hashes[0]) is not node:
                return False
            node = node.parent
        return node is self.tree.root

    # ---------------------------------------------------------------- write-through
    def after_insert(self, path: list[Node]) -> None:
        """Nodes of a request's pages were adopted by the tree (``path``, all in L1)."""
        if not self.has_disk:
            return
        for node in path:
            if node.tiers[DISK] is None and node.tiers[DEVICE] is not None and self.policy.write_through(node):
                self._to_disk(node, node.tiers[DEVICE], from_host=False)

    def after_hit(self, path: list[Node]) -> None:
        """A lookup matched ``path``: ``selective`` writes nodes that just became hot."""
        if not self.has_disk or self.policy.mode != SELECTIVE:
            return
        for node in path:
            if node.tiers[DISK] is None and self.policy.write_through(node):
                if node.tiers[DEVICE] is not None:
                    self._to_disk(node, node.tiers[DEVICE], from_host=False)
                elif node.tiers[HOST] is not None:
                    self._to_disk(node, node.tiers[HOST], from_host=True)

    # ---------------------------------------------------------------- loads
    def plan(self, hashes: list[bytes], path: list[Node],
             tokens: Sequence[int] | None = None) -> LoadJob | None:
        """What to load for a lookup of ``hashes`` (of ``tokens``, where known) that matched
        ``path``: None if nothing."""
        start, prefix, i = 0, [], 0
        while i < len(path) and path[i].tiers[DEVICE] is not None:
            prefix += path[i].tiers[DEVICE]
            start += path[i].num_pages
            i += 1
        sources: list[PageSource] = []
        ids: list[PageId | None] = []
        nodes: list[Node] = []
        for node in path[i:]:
            if node.tiers[HOST] is not None:
                sources += [(HOST, s) for s in node.tiers[HOST]]
                ids += [None] * node.num_pages
            elif node.tiers[DISK] is not None:
                sources += [(DISK, k) for k in node.tiers[DISK]]
                ids += self._page_ids(node.hashes, node.tokens)
            else:  # cannot happen (a node always holds a tier), but never load past a hole
                break
            nodes += [node] * node.num_pages
        probe: list[str] = []
        probe_ids: list[PageId] = []
        nxt = start + len(sources)
        if self.has_disk and nxt == sum(n.num_pages for n in path) and nxt < len(hashes):
            first = self.backend.disk_key(hashes[nxt])
            if self.backend.disk_contains(first):
                probe = [first] + [self.backend.disk_key(h) for h in hashes[nxt + 1 :]]
                ps = self.tree.page_size
                probe_ids = self._page_ids(hashes[nxt:], None if tokens is None
                                           else tokens[nxt * ps : len(hashes) * ps])
        if not sources and not probe:
            return None
        job = LoadJob(sources=sources, probe=probe, start=start, prefix_pages=prefix,
                      source_nodes=nodes, source_ids=ids, probe_ids=probe_ids)
        job.locked = path[-1] if path else None
        return job

    def adopted_disk_records(self, path: list[Node], job: LoadJob, end: int) -> None:
        """Record L3 for nodes made only of pages that the probe found on disk."""
        probe_start = job.start + len(job.sources)
        a = 0
        for node in path:
            b = a + node.num_pages
            if a >= probe_start and b <= end and node.tiers[DISK] is None and self._room(DISK, node.num_pages):
                self.tree.add_tier(node, DISK, list(job.probe[a - probe_start : b - probe_start]))
            a = b

    def forget_disk(self, node: Node) -> None:
        """``node``'s L3 record is stale (file gone or bad): drop it if that is safe now."""
        if node.tiers[DISK] is None or not self._attached(node):
            return
        others = any(node.tiers[t] is not None for t in (DEVICE, HOST))
        if others or node.lock_ref == 0:
            self.stale_disk_records += node.num_pages
            self.tree.drop_tier(node, DISK, self._release_cb)
            self.evicted[DISK] -= node.num_pages  # not an eviction

    def poll(self) -> None:
        """Forget L3 records whose background write failed; finish promotions."""
        if self.promoter is not None:
            self.promoter.poll()
        for key in self.backend.poll_failed_writes():
            node = self._disk_nodes.pop(key, None)
            if node is not None and node.tiers[DISK] is not None and key in node.tiers[DISK]:
                self.forget_disk(node)

    def stats(self) -> dict[str, Any]:
        return {"evicted": {TIER_NAMES[t]: self.evicted[t] for t in range(NUM_TIERS)},
                "pages": {TIER_NAMES[t]: self.tree.pages_in_tier[t] for t in range(NUM_TIERS)},
                "capacity": {TIER_NAMES[t]: self.capacity[t] for t in (HOST, DISK)},
                "stale_disk_records": self.stale_disk_records,
                "disk_skipped_too_large": self.skipped_too_large,
                "disk_skipped_no_room": self.skipped_no_room,
                "idle_promotion": self.promoter.stats() if self.promoter is not None else {}}
