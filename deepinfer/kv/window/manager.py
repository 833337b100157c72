"""The cache manager of models with a window group: prefix reuse on hybrid models.

A prefix hit of m tokens (whole pages, from the tree) gives the full group everything: its pages
are shared. The sliding group needs its state at the hit's end instead: the K/V of the W - 1
tokens before m in every sliding layer. Two ways to get it:

* **Window snapshot.** A copy of a sequence's ring contents for the window before a page
  boundary b (host memory, ``WindowSnapshotStore``: LRU under a byte budget; with an L3 tier
  also a file there, see below), keyed by the chained hash of the page ending at b, which names
  the whole token prefix (model and salt included). A sequence takes one when it crosses a
  cache-unit boundary: its turn end (on release: the last full page it handed the tree), the
  junction where its own lookup ended (another request diverged there), and every
  ``window_snapshot_interval`` tokens (default W). A hit restores the deepest snapshot at or
  before m into the new ring and recomputes the gap after it; with the default interval the gap
  is below W, so the compute of a hit is bounded by W plus the new tail.
* **Boundary replay.** Recompute the last tokens of the match with an empty ring. This is only
  exact if it starts far enough back: a sliding layer's output at p depends on its window before
  p, so every stacked window layer widens the span that must be recomputed by W - 1 tokens. The
  exact replay is ``sum(W_l - 1)`` over the window layers (``WindowLayout.replay_tokens``; for
  Gemma-3-270M 15 x 511 = 7665 tokens, i.e. everything for ordinary chats), starting at a page
  boundary with the window masked below its start. Replaying only W tokens, as naive "boundary
  replay" does, is *not* exact with more than one sliding layer; ``window_replay_tokens`` can set
  such a shorter, lossy replay on purpose (benchmarks), and then no snapshot is ever taken from the
  approximate state it leaves.

Either way the replayed tokens (in the tree, recomputed) count apart: ``num_replayed_tokens``,
excluded from ``num_cached_tokens``, so cached + replayed + computed == prompt tokens. Replay is
done by shortening the hit to the replay start b: the tree keeps its pages, the request recomputes
[b, m) into private pages (all layers: a sliding layer at p needs every lower layer's output at p)
and ``cache_pages`` finds the tree's copies and frees its own, so shared pages are never written.

``window_reuse``: ``snapshot`` (default: snapshots, exact replay when none is close enough),
``replay`` (never snapshot) or ``off`` (a hybrid model recomputes every hit: the baseline).
Snapshots in memory are dropped when their node leaves the tree through an L1 eviction; ones
whose node left from a lower tier age out by LRU (they stay correct: a snapshot is only found
through a matched page hash, which fixes the tokens it was computed from).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...request import Request
from ..cache_manager import KVCacheManager
from ..radix import DEVICE, DISK, HOST, NUM_TIERS, TIER_NAMES, Node
from .layout import WindowLayout
from .pool import WindowPool
from .rings import RingAllocator, RingState
from .snapshots import SnapshotFiles, WindowSnapshot, WindowSnapshotStore

REUSE_MODES = ("snapshot", "replay", "off")
NEVER = 1 << 62  # an ``exact_from`` no boundary reaches


@dataclass
class WindowReuse:
    """What ``WindowKVCacheManager`` needs to know about the window group."""

    layout: WindowLayout
    rings: RingAllocator
    io: WindowPool  # reads and writes ring pages (the manager itself holds no tensors)
    mode: str = "snapshot"  # snapshot | replay | off
    replay_tokens: int | None = None  # None: exact (layout.replay_tokens); less: lossy
    snapshot_interval: int = 0  # tokens between fixed-interval snapshots (0: none)
    snapshot_bytes: int = 1 << 30
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in REUSE_MODES:
            raise ValueError(f"window_reuse must be one of {', '.join(REUSE_MODES)}, got {self.mode!r}")
        if self.replay_tokens is None:
            self.replay_tokens = self.layout.replay_tokens


@dataclass
class WindowStats:
    replayed_tokens: int = 0  # tokens of prefix hits recomputed for the window layers
    snapshot_hits: int = 0  # admissions that restored a snapshot
    replays: int = 0  # admissions that replayed (no usable snapshot)
    snapshots_taken: int = 0
    snapshots_written: int = 0  # of which handed to the L3 writer
    snapshot_disk_hits: int = 0  # snapshots read from L3 for a hit
    snapshot_disk_failures: int = 0  # indexed snapshot files that did not read back (bad, gone)


class WindowKVCacheManager(KVCacheManager):
    """``KVCacheManager`` for models with a window group: rings, snapshots and replay on top of
    the page-granular prefix cache (see the module docstring)."""

    def __init__(self, *args, window: WindowReuse, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.window = window
        self.rings = window.rings
        self.max_chunk_tokens = window.chunk_tokens
        use_snapshots = window.mode == "snapshot" and self.tree is not None
        self.snapshots = WindowSnapshotStore(window.snapshot_bytes) if use_snapshots else None
        self.snapshot_files = (SnapshotFiles.create(self.tiers.backend, window.layout.owners,
                                                    window.io.page_shapes(), window.io.dtype)
                               if use_snapshots and self.tiers is not None and self.tiers.has_disk
                               else None)
        self.window_counters = WindowStats()

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, req: Request) -> int:
        first = req.num_cached_tokens is None
        matched = super().match_prefix(req)
        if req.ring is not None:  # leftovers of an attempt that never ran
            self.rings.free(req.ring)
        start, snap, exact_from = self._window_start(req, matched)
        ps = self.page_size
        req.ring = RingState(
            valid_from=snap.first_page * ps if snap is not None else start,
            exact_from=exact_from, snap_upto=start, junction=matched, restore=snap)
        if start < matched:
            self._shorten(req, start)
            self._count_replay(req, matched - start, first)
            if first and snap is None:
                self.window_counters.replays += 1
        return start

    def _window_start(self, req: Request, m: int) -> tuple[int, WindowSnapshot | None, int]:
        """Where this hit's computation starts: (position, snapshot to restore, exact_from)."""
        if m == 0 or self.window.mode == "off":
            return 0, None, 0
        ps = self.page_size
        exact = self.window.layout.replay_tokens
        replay = self.window.replay_tokens
        s = max(0, m - replay) // ps * ps
        exact_from = 0 if s == 0 else (s + exact if replay >= exact else NEVER)
        if self.snapshots is not None:
            for k in range(m // ps, 0, -1):  # deepest boundary first
                if k * ps < s:
                    break
                snap = self._find_snapshot(req.page_hashes[k - 1], k * ps)
                if snap is not None:
                    return k * ps, snap, k * ps
        return s, None, exact_from

    def _find_snapshot(self, key: bytes, b: int) -> WindowSnapshot | None:
        """The snapshot at boundary ``b``: in memory, else read from L3 (synchronously) and kept."""
        assert self.snapshots is not None
        snap = self.snapshots.get(key)
        files = self.snapshot_files
        if snap is None and files is not None and files.has(key):
            first, end = self._span(b)
            snap = files.read(key, first, end - first)
            if snap is None:
                self.window_counters.snapshot_disk_failures += 1
            else:
                self.window_counters.snapshot_disk_hits += 1
                self.snapshots.put(key, snap)
        return snap

    def _span(self, b: int) -> tuple[int, int]:
        """Absolute pages [first, end) of the window before page boundary ``b``."""
        return max(0, b - self.window.layout.window + 1) // self.page_size, b // self.page_size

    def _shorten(self, req: Request, start: int) -> None:
        """Keep only the first ``start`` tokens of the hit (the rest is recomputed privately)."""
        assert self.tree is not None
        k = start // self.page_size
        self.tree.unlock(req.locked_node)
        node = self.tree.match(req.page_hashes[:k], touch=False).last if k else None
        self.tree.lock(node)
        req.locked_node = node
        del req.pages[k:]
        req.num_tree_pages = k
        req.num_computed_tokens = start

    def _count_replay(self, req: Request, n: int, first: bool) -> None:
        if not first:  # a preempted request coming back: these are recomputed tokens
            req.num_recomputed_tokens += n
            return
        req.num_cached_tokens -= n
        req.num_replayed_tokens = n
        self.stats.hit_tokens -= n
        self.window_counters.replayed_tokens += n
        left = n  # the tail of a hit is what came from the lowest tiers
        for t in (DISK, HOST, DEVICE):
            name = TIER_NAMES[t]
            d = min(req.cached_tokens_by_tier.get(name, 0), left)
            if d:
                req.cached_tokens_by_tier[name] -= d
                self.stats.hit_tokens_by_tier[name] -= d
                left -= d
        disk = req.cached_tokens_by_tier.get(TIER_NAMES[DISK], 0)
        req.store_cached_tokens = min(req.store_cached_tokens, disk)
        req.prefill_worker_cached_tokens = min(req.prefill_worker_cached_tokens, disk)

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        if not super().allocate(req, num_new_tokens):
            return False
        if req.ring is None:
            req.ring = RingState()
        if not self.rings.ensure(req.ring, req.num_computed_tokens + num_new_tokens):
            return False
        snap = req.ring.restore
        if snap is not None:
            req.ring.restore = None
            self.window_counters.snapshot_hits += 1
            pages = [self.rings.page(req.ring, a)
                     for a in range(snap.first_page, snap.first_page + snap.num_pages)]
            self.window.io.write(pages, snap.data)
        return True

    def rollback(self, req: Request, num_new_tokens: int = 0) -> int:
        """Pages as ``KVCacheManager.rollback``, and the ring back to what the kept positions
        need: a verify span is at most one chunk, so it never wrapped over the window the
        kept prefix reads, and the slots it grew hold only positions past that prefix."""
        freed = super().rollback(req, num_new_tokens)
        if req.ring is not None:
            freed += self.rings.shrink(req.ring, req.num_computed_tokens + num_new_tokens)
        return freed

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """The parent's pages as ``KVCacheManager.fork`` shares them, and a ring of the child's
        own holding a copy of the parent's window: each sample then writes its own tokens in
        its ring. None (the child recomputes from the cache) when either pool is short."""
        ring = parent.ring
        if ring is None:
            return super().fork(parent, child)
        pages = self.rings.allocator.alloc(len(ring.pages))
        if pages is None:
            return None
        pairs = super().fork(parent, child)
        if pairs is None:
            self.rings.allocator.free(pages)
            return None
        child.ring = dataclasses.replace(ring, pages=pages)
        self.window.io.copy_pages(list(zip(ring.pages, pages)))
        return pairs

    # ------------------------------------------------------------------ snapshots
    def cache_pages(self, req: Request, num_tokens: int | None = None) -> None:
        super().cache_pages(req, num_tokens)
        ring = req.ring
        if self.snapshots is None or ring is None:
            return
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        lo = ring.snap_upto
        if n <= lo:
            return
        ring.snap_upto = n
        bounds = set()
        step = self.window.snapshot_interval
        if step:
            bounds.update(range((lo // step + 1) * step, n + 1, step))
        if lo < ring.junction <= n:
            bounds.add(ring.junction)
        for b in sorted(bounds):
            self._snapshot(req, b)

    def _snapshot(self, req: Request, b: int) -> None:
        """Store the window before page boundary ``b`` (``b`` in the tree, the ring still holding it)."""
        ring = req.ring
        ps = self.page_size
        assert self.snapshots is not None and ring is not None
        if b <= 0 or b < ring.exact_from or ring.restore is not None or b > req.num_tree_pages * ps:
            return
        key = req.page_hashes[b // ps - 1]
        if key in self.snapshots:
            return
        first, end = self._span(b)
        pages = [self.rings.page(ring, a) for a in range(first, end)]
        snap = WindowSnapshot(first, self.window.io.read(pages))
        if self.snapshots.put(key, snap):
            self.window_counters.snapshots_taken += 1
            if self.snapshot_files is not None and self.snapshot_files.write(key, snap, b):
                self.window_counters.snapshots_written += 1

    def release(self, req: Request) -> None:
        ring = req.ring
        if ring is not None:
            if self.snapshots is not None and self.tree is not None:  # the turn end
                self._snapshot(req, req.num_computed_tokens // self.page_size * self.page_size)
            self.rings.free(ring)
            req.ring = None
        super().release(req)

    def _release(self, node: Node, tier: int) -> None:
        super()._release(node, tier)  # (may demote the node to L2/L3 first)
        if self.snapshots is not None and all(
                node.tiers[t] is None for t in range(NUM_TIERS) if t != tier):
            self.snapshots.drop(node.hashes)  # the prefix leaves the cache: so do its windows

    # ------------------------------------------------------------------ stats
    def window_stats(self) -> dict[str, int]:
        c, s = self.window_counters, self.snapshots
        return {
            "window_replayed_tokens": c.replayed_tokens,
            "window_snapshot_hits": c.snapshot_hits,
            "window_replays": c.replays,
            "window_snapshots_taken": c.snapshots_taken,
            "window_snapshots_written": c.snapshots_written,
            "window_snapshot_disk_hits": c.snapshot_disk_hits,
            "window_snapshot_disk_failures": c.snapshot_disk_failures,
            "window_snapshots": len(s) if s is not None else 0,
            "window_snapshot_bytes": s.bytes if s is not None else 0,
            "window_snapshots_evicted": (s.evicted + s.dropped) if s is not None else 0,
            "window_ring_pages_used": self.rings.in_use,
            "window_ring_pages_total": self.rings.num_pages - 1,
        }

