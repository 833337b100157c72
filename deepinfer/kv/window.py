"""Sliding-window layers: per-sequence rings of pages, window snapshots, and prefix reuse on
hybrid models (Mistral, Gemma 2/3, gpt-oss: sliding-window layers, maybe mixed with global ones).

Two KV groups
-------------
Full-attention layers (and MLA, and any layer whose cache a full-attention layer reads) keep
every token in the ``PagePool``, addressed by the page ids that the radix tree and the lower
tiers (L2/L3) deal in. Sliding-window layers (``KVSpec.window``) keep their K/V in a separate
``WindowPool`` with its own allocator: each running sequence owns a *ring* of
``R = ceil((W - 1 + C) / page_size) + 1`` pages, position p living in ring slot
``(p // page_size) % R``. W is the largest window of the group, C the largest prefill chunk of
one sequence: the scheduler caps a hybrid model's chunks at C (``window_chunk_tokens``, default
W rounded up to a page), because a chunk's queries need the W - 1 tokens before the chunk and the
chunk itself in the ring at once (the model stores a step's K/V before attending). So chunked
prefill stays exact, a decode gathers only the ceil((W - 1) / page_size) + 1 pages its window
spans, and sliding-layer memory is O(W + C) per sequence however long it grows, while the full
group grows with the sequence. The page pool holds only the full group's buffers (window layers
get empty stand-in specs there), so tier copies (``PagePool.read_pages/write_pages`` over
``owned_buffers``) move exactly the bytes a tree page stands for; models without window layers
are untouched.

Prefix reuse on hybrid models
-----------------------------
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

Snapshots on L3
---------------
With a disk tier, every snapshot taken is also written to the L3 directory (``SnapshotFiles``:
the disk writer thread, under the pages' back-pressure; atomic files with a namespaced header and
a checksum), so a restarted engine, or another one sharing the directory, that loads a prefix's
pages from L3 gets its window too instead of replaying ``sum(W_l - 1)`` tokens. The file's key
hashes the boundary's page hash with a tag naming the window layout, dtype and codec, so it never
meets a page file or another layout's snapshot. A lookup that finds no snapshot in memory at a
boundary asks the store's in-memory index (no system call; so files another process wrote after
this one opened the directory are not seen) and reads the file *synchronously* at admission,
where the hit's length, and so the boundary wanted, is first known (the pages' load before it is
asynchronous): one file of about W tokens of the sliding layers, once per prefix and restart (it
is then kept in memory), against recomputing every layer over ``sum(W_l - 1)`` tokens. A bad,
truncated or foreign file is a counted miss (``window_snapshot_disk_failures``): the lookup goes
on to shallower boundaries, then replays. Snapshot files share the store's byte budget and LRU
with the page files and, like those, outlive the tree's records.

``window_reuse``: ``snapshot`` (default: snapshots, exact replay when none is close enough),
``replay`` (never snapshot) or ``off`` (a hybrid model recomputes every hit: the baseline).
Snapshots in memory are dropped when their node leaves the tree through an L1 eviction; ones
whose node left from a lower tier age out by LRU (they stay correct: a snapshot is only found
through a matched page hash, which fixes the tokens it was computed from).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .cache_manager import KVCacheManager
from .codecs import get_codec
from .layout import KVSpec
from .pool import PageAllocator
from .radix import DEVICE, DISK, HOST, NUM_TIERS, TIER_NAMES, Node
from .tier_policy import TierBackend, disk_key
from .tiers import decode_pages, encode_pages, page_nbytes

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..forward_batch import ForwardBatch
    from ..request import Request

REUSE_MODES = ("snapshot", "replay", "off")
NEVER = 1 << 62  # an ``exact_from`` no boundary reaches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class WindowLayout:
    """Which layers keep their KV in rings, and the numbers that follow from their windows."""

    layers: frozenset[int]  # owners and the layers reading their caches
    owners: tuple[int, ...]  # layers whose ring buffers exist (in order)
    window: int  # the largest window of the group (what a ring must cover)
    replay_tokens: int  # exact boundary replay: sum of (window - 1) over the group's layers

    @staticmethod
    def from_specs(specs: Sequence[KVSpec]) -> WindowLayout | None:
        """The window group of a model, or None when it has no sliding-window layer.

        A window layer's cache goes to a ring unless a full-attention layer reads it
        (cross-layer sharing): that reader needs every token, so the cache stays paged."""
        readers: dict[int, list[int]] = {}
        for i, s in enumerate(specs):
            if s.share_with is not None:
                readers.setdefault(s.share_with, []).append(i)
        layers: set[int] = set()
        owners: list[int] = []
        for i, s in enumerate(specs):
            if not s.owns_cache or s.window is None:
                continue
            if any(specs[r].window is None for r in readers.get(i, ())):
                continue
            owners.append(i)
            layers.add(i)
            layers.update(readers.get(i, ()))
        if not owners:
            return None
        windows = [specs[i].window for i in layers]
        return WindowLayout(frozenset(layers), tuple(owners), max(windows),
                            sum(w - 1 for w in windows))

    def page_specs(self, specs: Sequence[KVSpec]) -> list[KVSpec]:
        """What the page pool holds per layer: group layers keep their window and sharing but no
        components (no buffers, no bytes in a page, a distinct cache namespace)."""
        return [KVSpec((), s.window, s.share_with) if i in self.layers else s
                for i, s in enumerate(specs)]

    def chunk_tokens(self, page_size: int, max_num_batched_tokens: int,
                     requested: int | None = None) -> int:
        """Largest prefill chunk of one sequence (what the ring is sized for)."""
        c = requested or _cdiv(self.window, page_size) * page_size
        return max(1, min(c, max_num_batched_tokens))

    def ring_pages(self, page_size: int, chunk: int) -> int:
        return _cdiv(self.window - 1 + chunk, page_size) + 1

    def decode_pages(self, page_size: int) -> int:
        """Pages a decode's window spans at most."""
        return _cdiv(self.window - 1, page_size) + 1


# ------------------------------------------------------------------------------ rings


@dataclass(eq=False)
class RingState:
    """A running sequence's ring (``Request.ring``)."""

    pages: list[int] = field(default_factory=list)  # ring slot -> window-pool page (lazily grown)
    valid_from: int = 0  # positions below hold no K/V of this sequence: masked
    exact_from: int = 0  # boundaries from here on see an exact window (snapshots allowed)
    snap_upto: int = 0  # boundaries up to here were considered for snapshots
    junction: int = 0  # where the tree match ended (a boundary worth a snapshot)
    restore: WindowSnapshot | None = None  # to copy in at the first allocation


class RingAllocator:
    """Ring pages of the window pool (no tensors: the cache manager uses it as is)."""

    def __init__(self, num_pages: int, ring_pages: int, page_size: int) -> None:
        self.allocator = PageAllocator(num_pages)  # page 0: padding of gathered page tables
        self.size = ring_pages
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def in_use(self) -> int:
        return self.allocator.num_pages - 1 - self.allocator.num_free

    def ensure(self, ring: RingState, num_tokens: int) -> bool:
        """Grow ``ring`` to hold positions below ``num_tokens``; False if the pool is short."""
        need = min(self.size, _cdiv(num_tokens, self.page_size)) - len(ring.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        ring.pages += pages
        return True

    def free(self, ring: RingState) -> None:
        self.allocator.free(ring.pages)
        ring.pages = []

    def page(self, ring: RingState, abs_page: int) -> int:
        """Window-pool page holding absolute page ``abs_page`` (0, masked, if none)."""
        if abs_page < 0:
            return 0
        i = abs_page % self.size
        return ring.pages[i] if i < len(ring.pages) else 0


class WindowPool:
    """Device buffers of the window group: ``[num_pages, page_size, *shape]`` per component of
    each owner layer (readers share their owner's), plus the ring allocator."""

    def __init__(self, specs: Sequence[KVSpec], layout: WindowLayout, num_pages: int,
                 ring_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.rings = RingAllocator(num_pages, ring_pages, page_size)
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        for i in sorted(layout.layers):  # owners come before their readers
            s = specs[i]
            if s.share_with is not None:
                self.buffers[i] = self.buffers[s.share_with]
                continue
            self.buffers[i] = {name: torch.zeros(num_pages, page_size, *shape, dtype=dtype, device=device)
                               for name, shape in s.components}

    @staticmethod
    def bytes_per_page(specs: Sequence[KVSpec], layout: WindowLayout, page_size: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(specs[i].elements_per_token() for i in layout.owners) * page_size * elem

    def owned_buffers(self) -> list[torch.Tensor]:
        return [buf for i in self.layout.owners for buf in self.buffers[i].values()]

    def read(self, pages: list[int]) -> list[torch.Tensor]:
        """Host copies of ``pages`` of every owned buffer, [n, page_size, ...] each."""
        idx = torch.tensor(pages, device=self.device)
        return [buf.index_select(0, idx).to("cpu") for buf in self.owned_buffers()]  # new tensors

    def write(self, pages: list[int], data: list[torch.Tensor]) -> None:
        idx = torch.tensor(pages, device=self.device)
        for buf, d in zip(self.owned_buffers(), data):
            buf.index_copy_(0, idx, d.to(device=buf.device, dtype=buf.dtype))

    def view(self, batch: ForwardBatch, decodes: list[tuple[Request, int]],
             prefills: list[tuple[Request, int]], chunk_limit: int) -> ForwardBatch:
        """The batch as the window layers see it: ring slots for the new tokens and, per
        sequence, the ring pages of its window in position order (masked below its start)."""
        from ..forward_batch import ForwardBatch, PrefillSegment

        rings, ps, R = self.rings, self.page_size, self.rings.size
        dev = self.device
        slots: list[int] = []
        dec_pages: list[list[int]] = []
        dec_start: list[int] = []
        dec_lo: list[int] = []
        D = self.layout.decode_pages(ps)
        for r, _ in decodes:
            ring, pos = r.ring, r.num_computed_tokens
            P = pos // ps
            slots.append(rings.page(ring, P) * ps + pos % ps)
            dec_pages.append([rings.page(ring, a) for a in range(P - D + 1, P + 1)])
            dec_start.append((P - D + 1) * ps)
            dec_lo.append(ring.valid_from)
        segments: list[PrefillSegment] = []
        for (r, n), seg in zip(prefills, batch.prefills):
            if n > chunk_limit:
                raise ValueError(f"a prefill chunk of {n} tokens exceeds the sliding-window ring "
                                 f"(built for chunks of at most {chunk_limit}: window_chunk_tokens)")
            ring, c = r.ring, r.num_computed_tokens
            pos = torch.arange(c, c + n)
            table = torch.tensor(ring.pages)
            slots += (table[(pos // ps) % R] * ps + pos % ps).tolist()
            first = max(0, c - self.layout.window + 1, ring.valid_from) // ps
            pages = [rings.page(ring, a) for a in range(first, (c + n - 1) // ps + 1)]
            segments.append(PrefillSegment(q_start=seg.q_start, q_len=n, kv_len=c + n,
                                           pages=torch.tensor(pages, device=dev),
                                           kv_start=first * ps, kv_lo=ring.valid_from))
        return ForwardBatch(
            input_ids=batch.input_ids, positions=batch.positions,
            slot_mapping=torch.tensor(slots, device=dev, dtype=torch.long), page_size=ps,
            num_decodes=batch.num_decodes,
            decode_pages=torch.tensor(dec_pages, device=dev) if decodes else None,
            decode_kv_lens=batch.decode_kv_lens, prefills=segments,
            logits_indices=batch.logits_indices,
            decode_kv_start=torch.tensor(dec_start, device=dev) if decodes else None,
            decode_kv_lo=torch.tensor(dec_lo, device=dev) if decodes else None)


# ------------------------------------------------------------------------------ snapshots


@dataclass(eq=False)
class WindowSnapshot:
    """Ring contents of absolute pages [first_page, first_page + num_pages) of every owned
    window buffer, on the host."""

    first_page: int
    data: list[torch.Tensor]  # per owned buffer: [num_pages, page_size, ...]

    @property
    def num_pages(self) -> int:
        return self.data[0].shape[0] if self.data else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


class WindowSnapshotStore:
    """Snapshots by page hash, least recently used dropped first to stay under ``capacity``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, WindowSnapshot] = OrderedDict()
        self.stored = 0
        self.evicted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> WindowSnapshot | None:
        snap = self._items.get(key)
        if snap is not None:
            self._items.move_to_end(key)
        return snap

    def put(self, key: bytes, snap: WindowSnapshot) -> bool:
        size = snap.nbytes
        if size > self.capacity or key in self._items:
            return False
        while self.bytes + size > self.capacity:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        self._items[key] = snap
        self.bytes += size
        self.stored += 1
        return True

    def drop(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            snap = self._items.pop(k, None)
            if snap is not None:
                self.bytes -= snap.nbytes
                self.dropped += 1


LOSSLESS = get_codec("lossless")


@dataclass
class SnapshotFiles:
    """Window snapshots as L3 files, next to the page files (see the module docstring).

    Always lossless, whatever the disk codec: a restored window is the state every later token
    of the sliding layers builds on, and the snapshots taken from it later count as exact, so a
    lossy copy would compound its error over turns and restarts (the reason a lossy replay never
    leaves a snapshot); and one snapshot saves recomputing ``sum(W_l - 1)`` tokens, worth its
    bytes."""

    backend: TierBackend  # the tiers' (``tiers.TierIO`` in the engine)
    shapes: list[tuple[int, ...]]  # one page of each owned window buffer
    dtype: torch.dtype
    tag: str  # hashed into every key: no collision with page files or another window layout

    @staticmethod
    def for_pool(backend: TierBackend, pool: WindowPool) -> SnapshotFiles:
        """The tag also names the disk codec, which is part of the store's namespace: engines
        with different disk codecs keep apart files rather than taking each other's as foreign."""
        shapes = [tuple(b.shape[1:]) for b in pool.owned_buffers()]
        tag = (f"window-snapshot|{pool.layout.owners}|{shapes}|{pool.dtype}|{LOSSLESS.tag}"
               f"|store={backend.codec_tag}")
        return SnapshotFiles(backend, shapes, pool.dtype, tag)

    def key(self, page_hash: bytes) -> str:
        return disk_key(page_hash, self.tag)

    def nbytes(self, num_pages: int) -> int:
        return num_pages * page_nbytes(LOSSLESS, self.shapes, self.dtype)

    def has(self, page_hash: bytes) -> bool:
        """Cheap: the store's in-memory index only."""
        return self.backend.disk_contains(self.key(page_hash), indexed=True)

    def write(self, page_hash: bytes, snap: WindowSnapshot, boundary: int) -> bool:
        """Queue ``snap`` (the window before ``boundary``) for the L3 writer unless already there."""
        if self.has(page_hash):
            return False
        return self.backend.write_file(self.key(page_hash), lambda: encode_pages(LOSSLESS, snap.data),
                                       self.nbytes(snap.num_pages), boundary)

    def read(self, page_hash: bytes, first_page: int, num_pages: int) -> WindowSnapshot | None:
        """The snapshot of pages [first_page, first_page + num_pages), None if its file is absent,
        bad or of another size."""
        raw = self.backend.read_file(self.key(page_hash), self.nbytes(num_pages))
        if raw is None:
            return None
        rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(num_pages, -1)
        return WindowSnapshot(first_page, decode_pages(LOSSLESS, rows, self.shapes, self.dtype))


# ------------------------------------------------------------------------------ cache manager


@dataclass
class WindowReuse:
    """What ``WindowKVCacheManager`` needs to know about the window group."""

    layout: WindowLayout
    rings: RingAllocator
    io: Any  # WindowPool (read/write of ring pages); the manager itself holds no tensors
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
        self.snapshot_files = (SnapshotFiles.for_pool(self.tiers.backend, window.io)
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

    # ------------------------------------------------------------------ snapshots
    def cache_pages(self, req: Request) -> None:
        super().cache_pages(req)
        ring = req.ring
        if self.snapshots is None or ring is None:
            return
        n, lo = req.num_computed_tokens, ring.snap_upto
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
    def window_stats(self) -> dict:
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


# ------------------------------------------------------------------------------ wiring


def manager_factory(runner: Any, config: EngineConfig):
    """The cache manager class for ``runner``'s model: ``KVCacheManager`` unless it has a window
    group, else ``WindowKVCacheManager`` with its window settings bound."""
    pool = getattr(runner, "window", None)
    if pool is None:
        return KVCacheManager
    layout = pool.layout
    interval = config.window_snapshot_interval
    if interval is None:
        interval = layout.window
    interval = _cdiv(interval, config.page_size) * config.page_size if interval else 0
    reuse = WindowReuse(layout=layout, rings=pool.rings, io=pool, mode=config.window_reuse,
                        replay_tokens=config.window_replay_tokens, snapshot_interval=interval,
                        snapshot_bytes=int(config.window_snapshot_gb * 2**30),
                        chunk_tokens=runner.window_chunk_tokens)
    return partial(WindowKVCacheManager, window=reuse)


def window_pool_pages(layout: WindowLayout, ring_pages: int, page_bytes: int, max_num_seqs: int,
                      budget_bytes: float | None) -> int:
    """Window-pool size: a full ring for every sequence slot, but (when the pool is sized by
    memory) at most half the KV budget; never less than one ring. Page 0 is padding."""
    pages = max_num_seqs * ring_pages
    if budget_bytes is not None and page_bytes:
        pages = min(pages, max(ring_pages, int(budget_bytes / 2 // page_bytes)))
    return pages + 1
