"""Radix tree over pages: the one prefix index of the engine (and of the capacity planner).

Keys are chained page hashes (see ``hashing.py``): a page's hash already encodes every token
before it, so comparing hashes page by page is comparing token prefixes, and the tree needs
no model. A node holds a run of pages that always travel together; nodes split at page
boundaries where prefixes diverge (common-prefix junctions), where a request locks a prefix
(turn boundaries), and are capped at ``max_node_pages`` (fixed intervals), which bounds the
granularity of eviction and of tier moves.

Every node records, per tier, where its pages live: ``tiers[DEVICE]`` is a list of L1 page
ids, ``tiers[HOST]`` a list of L2 slots, ``tiers[DISK]`` a list of L3 keys (or ``True``
placeholders in the planner). A tier value of ``None`` means absent. Eviction works per tier
and only on that tier's "leaves" (nodes no child of which holds the tier), in LRU order, and
never touches locked nodes. A node that holds no tier any more is useless together with its
whole subtree (its descendants' KV needs this prefix), so the subtree is dropped.

A ``listener`` (the server's KV event log, for routers) is told of every page that enters or
leaves a tier; splits change no page's tiers, so they tell it nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

DEVICE, HOST, DISK = 0, 1, 2
NUM_TIERS = 3
TIER_NAMES = ("device", "host", "disk")


@dataclass(eq=False)
class Node:
    hashes: list[bytes]
    tokens: list[int] | None
    parent: Node | None
    tiers: list[list[Any] | None] = field(default_factory=lambda: [None] * NUM_TIERS)
    children: dict[bytes, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0  # lookups that reached this node (inserts do not count)

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    def holds(self, tier: int) -> bool:
        return self.tiers[tier] is not None

    def best_tier(self) -> int | None:
        for t in range(NUM_TIERS):
            if self.tiers[t] is not None:
                return t
        return None


@dataclass
class Match:
    """Result of a lookup: the matched path (root excluded) and its length in pages."""

    path: list[Node]
    num_pages: int

    @property
    def last(self) -> Node | None:
        return self.path[-1] if self.path else None


ReleaseFn = Callable[[Node, int], None]


class TreeListener(Protocol):
    """Told when pages enter or leave a tier (the workers' KV event stream). It runs on the
    tree's own thread, inside inserts and evictions, so it must only record, never wait."""

    def stored(self, hashes: list[bytes], tier: int) -> None: ...

    def removed(self, hashes: list[bytes], tier: int) -> None: ...


class RadixTree:
    def __init__(self, page_size: int, max_node_pages: int = 64) -> None:
        self.page_size = page_size
        self.max_node_pages = max_node_pages
        self.root = Node(hashes=[], tokens=[], parent=None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._heaps: list[list[tuple[int, int, Node]]] = [[] for _ in range(NUM_TIERS)]
        self._seq = 0
        self.pages_in_tier = [0] * NUM_TIERS
        self.listener: TreeListener | None = None

    # ------------------------------------------------------------------ lookup
    def match(self, hashes: Sequence[bytes], touch: bool = True, count_hit: bool = True,
              start: Node | None = None) -> Match:
        """Longest cached prefix of ``hashes`` (in whole pages), splitting a node where it ends.

        ``touch`` refreshes the path's LRU age; ``count_hit`` also counts a hit on every node
        of the path (what the ``selective`` tier policy looks at). ``start`` matches below
        that node instead of the root (``hashes`` then continue its chain)."""
        path: list[Node] = []
        node, i = start or self.root, 0
        while i < len(hashes):
            child = node.children.get(hashes[i])
            if child is None:
                break
            n = common_len(child.hashes, hashes, i)
            if n < child.num_pages:
                child = self._split(child, n)
            path.append(child)
            node, i = child, i + n
        if touch:
            self._touch(path, count_hit)
        return Match(path=path, num_pages=i)

    def _touch(self, path: list[Node], count_hit: bool = False) -> None:
        self._clock += 1
        for n in path:
            n.last_access = self._clock
            n.hits += count_hit
        if path:
            self._push_candidate(path[-1])

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int] | None,
        tier: int,
        values: Sequence[Any],
        below: Node | None = None,
    ) -> tuple[Match, list[Any]]:
        """Insert a page chain whose pages are held in ``tier`` at ``values`` (one per page).

        ``below`` (default: the root) is a node the chain continues: a request that already
        owns a prefix in the tree inserts only its new pages, so a long sequence growing page
        by page does not re-walk its whole prefix each time. The LRU age of the whole path
        from the root is refreshed either way.

        Returns the match of the chain (nodes below ``below``) and, per page, the value the
        tree keeps: the caller's value where the tree adopted it (new node, or an existing node
        that lacked this tier), the tree's own value where it already held the page in that
        tier (the caller then drops its duplicate copy).
        """
        assert len(values) == len(hashes)
        m = self.match(hashes, touch=False, start=below)
        kept: list[Any] = []
        for node in m.path:
            off = len(kept)
            if node.tiers[tier] is None:
                node.tiers[tier] = list(values[off : off + node.num_pages])
                self.pages_in_tier[tier] += node.num_pages
                self._push_candidate(node)
                self._stored(node, tier)
            kept.extend(node.tiers[tier])
        parent = m.last or below or self.root
        i = m.num_pages
        while i < len(hashes):
            j = min(len(hashes), i + self.max_node_pages)
            ps = self.page_size
            node = Node(
                hashes=list(hashes[i:j]),
                tokens=None if tokens is None else list(tokens[i * ps : j * ps]),
                parent=parent,
            )
            node.tiers[tier] = list(values[i:j])
            self.pages_in_tier[tier] += j - i
            parent.children[node.hashes[0]] = node
            self._stored(node, tier)
            m.path.append(node)
            kept.extend(node.tiers[tier])
            parent, i = node, j
        m.num_pages = len(hashes)
        ancestors = []
        node = below
        while node is not None and node is not self.root:
            ancestors.append(node)
            node = node.parent
        self._touch(ancestors[::-1] + m.path)
        return m, kept

    def add_tier(self, node: Node, tier: int, values: list[Any]) -> None:
        """Record that ``node``'s pages now also live in ``tier`` (a copy was made)."""
        assert node.tiers[tier] is None and len(values) == node.num_pages
        node.tiers[tier] = values
        self.pages_in_tier[tier] += node.num_pages
        self._push_candidate(node)
        self._stored(node, tier)

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node | None) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self._push_candidate(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, tier: int, num_pages: int, release: ReleaseFn,
              older_than: int | None = None) -> int:
        """Drop at least ``num_pages`` pages from ``tier`` (LRU leaves of that tier first).

        ``release(node, tier)`` is called before a node loses a tier so the caller can move
        or free the data (demote to a lower tier, free L1 pages, delete a file).
        ``older_than``: only nodes last touched before that ``last_access`` stamp.
        Returns the number of pages dropped from ``tier`` (less if not enough evictable).
        """
        heap = self._heaps[tier]
        dropped = 0
        while dropped < num_pages and heap:
            stamp, _, node = heapq.heappop(heap)
            if not self._evictable(node, tier):
                continue
            if stamp != node.last_access:  # touched since pushed: requeue at its new age
                self._seq += 1
                heapq.heappush(heap, (node.last_access, self._seq, node))
                continue
            if older_than is not None and stamp >= older_than:  # the rest is younger still
                self._seq += 1
                heapq.heappush(heap, (stamp, self._seq, node))
                break
            dropped += node.num_pages
            self._drop_tier(node, tier, release)
        return dropped

    def evictable_pages(self, tier: int) -> int:
        """Pages of ``tier`` that no lock protects (walks the tree: for stats, not hot paths)."""
        total, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and n.lock_ref == 0 and n.tiers[tier] is not None:
                total += n.num_pages
        return total

    def drop_tier(self, node: Node, tier: int, release: ReleaseFn) -> None:
        """Forget that ``node``'s pages live in ``tier`` (e.g. its L3 files turned out to be gone),
        as eviction would; a node left with no tier goes with its subtree. Never on locked nodes
        that would lose their last tier."""
        assert node.tiers[tier] is not None
        assert node.lock_ref == 0 or any(node.tiers[t] is not None for t in range(NUM_TIERS) if t != tier)
        self._drop_tier(node, tier, release)

    def _evictable(self, node: Node, tier: int) -> bool:
        return (
            node.parent is not None
            and node.lock_ref == 0
            and node.tiers[tier] is not None
            and not any(c.tiers[tier] is not None for c in node.children.values())
        )

    def _push_candidate(self, node: Node) -> None:
        for t in range(NUM_TIERS):
            if self._evictable(node, t):
                self._seq += 1
                heapq.heappush(self._heaps[t], (node.last_access, self._seq, node))

    def _drop_tier(self, node: Node, tier: int, release: ReleaseFn) -> None:
        release(node, tier)
        node.tiers[tier] = None
        self.pages_in_tier[tier] -= node.num_pages
        self._removed(node, tier)
        parent = node.parent
        if node.best_tier() is None:
            self._remove_subtree(node, release)
        else:
            self._push_candidate(node)
        if parent is not None:
            self._push_candidate(parent)

    def _remove_subtree(self, node: Node, release: ReleaseFn) -> None:
        """Detach ``node`` and release every tier of every descendant (useless without it)."""
        assert node.parent is not None
        del node.parent.children[node.hashes[0]]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for t in range(NUM_TIERS):
                if n.tiers[t] is not None:
                    release(n, t)
                    self.pages_in_tier[t] -= n.num_pages
                    n.tiers[t] = None
                    self._removed(n, t)
        node.parent = None

    def _stored(self, node: Node, tier: int) -> None:
        if self.listener is not None:
            self.listener.stored(node.hashes, tier)

    def _removed(self, node: Node, tier: int) -> None:
        if self.listener is not None:
            self.listener.removed(node.hashes, tier)

    def held_pages(self) -> list[tuple[bytes, int]]:
        """Every (page hash, tier) the tree holds: the snapshot a listener's state starts from."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            out += [(h, t) for t in range(NUM_TIERS) if n.tiers[t] is not None for h in n.hashes]
        return out

    # ------------------------------------------------------------------ structure
    def _split(self, node: Node, k: int) -> Node:
        """Split ``node`` after its first ``k`` pages; returns the new upper part."""
        assert 0 < k < node.num_pages
        ps = self.page_size
        upper = Node(
            hashes=node.hashes[:k],
            tokens=None if node.tokens is None else node.tokens[: k * ps],
            parent=node.parent,
            tiers=[None if v is None else v[:k] for v in node.tiers],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hits=node.hits,
        )
        node.hashes = node.hashes[k:]
        node.tokens = None if node.tokens is None else node.tokens[k * ps :]
        node.tiers = [None if v is None else v[k:] for v in node.tiers]
        assert node.parent is not None
        node.parent.children[upper.hashes[0]] = upper
        upper.children[node.hashes[0]] = node
        node.parent = upper
        return upper

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            n = stack.pop()
            count += 1
            stack.extend(n.children.values())
        return count - 1


def common_len(a: Sequence[Hashable], b: Sequence[Hashable], b_off: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[b_off:]`` (page hashes, token ids)."""
    n = min(len(a), len(b) - b_off)
    if a[:n] == b[b_off : b_off + n]:  # the usual case: one C-level comparison
        return n
    i = 0
    while i < n and a[i] == b[b_off + i]:
        i += 1
    return i
