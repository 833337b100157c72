"""A prefill worker's side of the direct route (``transfer.py``): a prompt's computed pages kept
in its registered arena until the decode worker has read them.

``capture`` runs on the engine thread right after the prefill: it copies the prompt's leading
full pages that are still in L1 (one gather, so the pool may reuse them at once). The call it
returns encodes them with the L3 codec into the store's page format (``tiers/disk_file.py``:
the same bytes a store would hold, checksummed and bound to the page) in one arena range, with
their manifest after them (``transfer.py``), and answers the ``TransferDescriptor``. The
range is freed when the decode worker says so
(``release``) or when its TTL runs out (a decode worker that never came); an arena without
room refuses the export, and the caller takes the store route instead.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from .cache_manager import KVCacheManager
from .publish import PagePlan, l1_pages
from .tiers.page_bytes import encode_pages
from .tiers.tier_io import TierIO
from .transfer import Arena, TransferDescriptor, TransferLink

EXPORT_COUNTERS = ("exports", "pages_exported", "bytes_exported", "released", "expired", "refused")


@dataclass
class _Export:
    offset: int
    nbytes: int
    expires: float  # time.monotonic() after which the range is freed unreleased


class PageExporter:
    """Exports of one prefill worker (see the module doc)."""

    def __init__(self, kv: KVCacheManager, tiers: TierIO, link: TransferLink, nbytes: int,
                 ttl_s: float) -> None:
        assert tiers.remote is not None  # the role needs the store (its page format, fallback)
        self.kv, self.tiers = kv, tiers
        self.format = tiers.remote.format
        self.session = link.session
        self.arena = Arena(link, nbytes)
        self.ttl_s = ttl_s
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(EXPORT_COUNTERS, 0)

    def capture(self, plan: PagePlan) -> Callable[[str], TransferDescriptor | None] | None:
        """Engine thread: the plan's leading pages still in L1, copied out; None if there
        are none. The call returned (any thread; its argument: the release URL) stages them
        and answers their descriptor, or None if the arena has no room."""
        pages = l1_pages(self.kv, plan)
        if not pages:
            return None
        data = self.tiers.transfer.read_pages(pages)
        return lambda release_url: self._stage(plan, data, len(pages), release_url)

    def _stage(self, plan: PagePlan, data, n: int, release_url: str) -> TransferDescriptor | None:
        rows = encode_pages(self.tiers.disk_codec, data).cpu().numpy()
        files = []
        for i in range(n):
            head = self.format.head(plan.keys[i], rows.shape[1], self.kv.page_size, plan.ids[i])
            files.append((head, self.format.tag(head, rows[i])))
        size = len(files[0][0]) + rows.shape[1] + len(files[0][1])
        # headers are fixed-size fields in practice; a run stops at one that is not
        n = next((i for i, (h, t) in enumerate(files) if len(h) + rows.shape[1] + len(t) != size), n)
        manifest = b"".join(plan.hashes[i] + tag for i, (_, tag) in enumerate(files[:n]))
        nbytes = n * size + len(manifest)
        self.sweep()
        off = self._alloc(nbytes)
        if off is None:
            return None
        out = self.arena.buffer.numpy()
        for i, (head, tag) in enumerate(files[:n]):
            at = off + i * size
            for part in (np.frombuffer(head, np.uint8), rows[i], np.frombuffer(tag, np.uint8)):
                out[at : at + part.size] = part
                at += part.size
        out[off + n * size : off + nbytes] = np.frombuffer(manifest, np.uint8)
        tid = uuid.uuid4().hex
        with self._lock:
            self._exports[tid] = _Export(off, nbytes, time.monotonic() + self.ttl_s)
            self.counters["exports"] += 1
            self.counters["pages_exported"] += n
            self.counters["bytes_exported"] += nbytes
        base = self.arena.address + off
        return TransferDescriptor(tid, self.session, base, size, n, base + n * size,
                                  xxhash.xxh3_128(manifest).hexdigest(), release_url)

    def _alloc(self, nbytes: int) -> int | None:
        off = self.arena.alloc(nbytes)
        if off is None:
            with self._lock:
                self.counters["refused"] += 1
        return off

    def release(self, transfer_id: str) -> bool:
        """Free an export's range (the decode worker has its pages); False if unknown."""
        with self._lock:
            e = self._exports.pop(transfer_id, None)
            if e is not None:
                self.counters["released"] += 1
        if e is not None:
            self.arena.free(e.offset, e.nbytes)
        return e is not None

    def sweep(self) -> None:
        """Free the ranges whose TTL ran out."""
        now = time.monotonic()
        with self._lock:
            gone = [t for t, e in self._exports.items() if e.expires <= now]
            freed = [self._exports.pop(t) for t in gone]
            self.counters["expired"] += len(freed)
        for e in freed:
            self.arena.free(e.offset, e.nbytes)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "live": len(self._exports),
                    "free_bytes": self.arena.free_bytes()}

    def close(self) -> None:
        self.arena.close()
