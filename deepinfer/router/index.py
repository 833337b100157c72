"""The router's global prefix index: which worker holds which pages, in which tier.

Fed by the workers' KV events (``server/kv_events.py``). Chained page hashes cover every
token before them, so a worker holds a prompt's first k pages exactly when it holds the
hashes of pages 1..k; the index is a plain set of (hash -> tiers) per worker, no tree.

Events arrive after the fact (a worker reports pages once it has stored them), so the router
also records the pages of each request it sends as *pending* on that worker (sglang's
cache_aware inserts on route the same way): the next turn of that conversation, or a
concurrent request sharing its prefix, counts them before any event says so. A pending page
lasts until an event about it (stored: now held; removed: evicted), the worker's index is
reset or dropped, the request fails, or ``pending_ttl_s`` passes.

Workers that share one KV pool (``--kv-store``) report the pages they wrote there as their L3
("disk") tier, so the index also tells which pages any of them can load from the pool
(``pooled``) and which a peer has computed or is computing but not yet written (``coming``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..kv.radix import TIER_NAMES

_TIER = {name: i for i, name in enumerate(TIER_NAMES)}
_DEVICE = 1 << _TIER["device"]
_DISK = 1 << _TIER["disk"]


@dataclass
class Overlap:
    """A worker's leading cached pages of one prompt, per tier (where the first copy is), and
    how many of them are only pending (routed there, not confirmed by an event yet)."""

    pages: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    pending: int = 0
    pooled: int = 0  # the next pages after ``pages``, in the worker's shared pool (it loads them)


class PrefixIndex:
    def __init__(self, pending_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._held: dict[str, dict[bytes, int]] = {}  # worker -> page hash -> tier bitmask
        self._pending: dict[str, dict[bytes, float]] = {}  # worker -> page hash -> expiry
        self._device: dict[str, int] = {}  # worker -> how many of its held pages are in L1
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock

    def reset(self, worker: str, pages: dict[str, Sequence[str]]) -> None:
        """Replace what ``worker`` holds (a ``/kv/snapshot``: tier name -> hex hashes)."""
        held: dict[bytes, int] = {}
        for tier, hashes in pages.items():
            bit = 1 << _TIER[tier]
            for h in hashes:
                key = bytes.fromhex(h)
                held[key] = held.get(key, 0) | bit
        self._held[worker] = held
        self._device[worker] = sum(1 for bits in held.values() if bits & _DEVICE)
        self._pending.pop(worker, None)

    def drop(self, worker: str) -> None:
        self._held.pop(worker, None)
        self._pending.pop(worker, None)
        self._device.pop(worker, None)

    def apply(self, worker: str, events: Iterable[dict]) -> None:
        """Apply ``/kv/events`` entries (stored/removed, tier, hex hashes) in order."""
        held = self._held.setdefault(worker, {})
        pending = self._pending.get(worker, {})
        device = self._device.get(worker, 0)
        for e in events:
            bit = 1 << _TIER[e["tier"]]
            stored = e["type"] == "stored"
            for h in e["hashes"]:
                key = bytes.fromhex(h)
                pending.pop(key, None)  # confirmed, or evicted: the event knows better
                was = held.get(key, 0)
                now = was | bit if stored else was & ~bit
                device += bool(now & _DEVICE) - bool(was & _DEVICE)
                if now:
                    held[key] = now
                else:
                    held.pop(key, None)
        self._device[worker] = device

    def add_pending(self, worker: str, hashes: Sequence[bytes]) -> None:
        """``hashes`` (a request routed to ``worker``) are expected there soon."""
        held = self._held.get(worker, {})
        pending = self._pending.setdefault(worker, {})
        now = self._clock()
        _prune(pending, now)
        for h in hashes:
            if h not in held:
                pending.pop(h, None)  # to the end: the dict stays in expiry order
                pending[h] = now + self.pending_ttl_s

    def forget_pending(self, worker: str, hashes: Sequence[bytes]) -> None:
        """The request that added ``hashes`` failed: they are not coming."""
        pending = self._pending.get(worker, {})
        for h in hashes:
            pending.pop(h, None)

    def overlap(self, worker: str, hashes: Sequence[bytes]) -> Overlap:
        """How many leading pages of ``hashes`` the worker holds (any tier) or has pending."""
        held = self._held.get(worker, {})
        pending = self._pending.get(worker, {})
        now = self._clock()
        out = Overlap()
        for h in hashes:
            bits = held.get(h, 0)
            if bits:
                out.by_tier[TIER_NAMES[(bits & -bits).bit_length() - 1]] += 1
            elif pending.get(h, 0.0) > now:
                out.pending += 1
            else:
                break
            out.pages += 1
        return out

    def pooled(self, peers: Sequence[str], hashes: Sequence[bytes], start: int) -> int:
        """How many pages of ``hashes`` from ``start`` on some of ``peers`` (workers sharing
        one pool) hold in L3, i.e. wrote to the pool: a run, as a load stops at a hole."""
        held = [self._held.get(p, {}) for p in peers]
        n = start
        while n < len(hashes) and any(h.get(hashes[n], 0) & _DISK for h in held):
            n += 1
        return n - start

    def coming(self, peers: Sequence[str], hashes: Sequence[bytes], start: int) -> int:
        """How many pages of ``hashes`` from ``start`` some of ``peers`` hold or have pending
        (in a run): pages a peer computed or is computing, so its pool will hold them."""
        now = self._clock()
        held = [self._held.get(p, {}) for p in peers]
        pending = [self._pending.get(p, {}) for p in peers]
        n = start
        while n < len(hashes) and (any(hashes[n] in h for h in held)
                                   or any(q.get(hashes[n], 0.0) > now for q in pending)):
            n += 1
        return n - start

    def servable(self, worker: str, peers: Sequence[str], hashes: Sequence[bytes]) -> bool:
        """Whether ``worker`` holds each of ``hashes`` (by its events) or can load it from the
        pool (some of ``peers`` wrote it there)."""
        own = self._held.get(worker, {})
        held = [self._held.get(p, {}) for p in peers]
        return all(h in own or any(x.get(h, 0) & _DISK for x in held) for h in hashes)

    def num_pages(self, worker: str) -> int:
        return len(self._held.get(worker, {}))

    def device_pages(self, worker: str) -> int:
        """Pages the worker holds in its device pool (L1), by its events."""
        return self._device.get(worker, 0)

    def num_pending(self, worker: str) -> int:
        pending = self._pending.get(worker, {})
        _prune(pending, self._clock())
        return len(pending)


def _prune(pending: dict[bytes, float], now: float) -> None:
    """Drop the expired entries: the oldest first (insertion order is expiry order)."""
    while pending:
        h = next(iter(pending))
        if pending[h] > now:
            return
        del pending[h]
