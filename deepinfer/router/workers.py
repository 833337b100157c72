"""The router's view of each worker: health, load it put there, what it routed and measured.

A worker that fails its health check (connect error, timeout, non-200 on ``/health``) or
refuses a connection leaves rotation at once; the health loop puts it back when ``/health``
answers 200 again, and its prefix index is rebuilt from its snapshot then.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from .index import PrefixIndex

log = logging.getLogger("deepinfer.router")


@dataclass
class Routed:
    """One request the router has open on a worker, and the load it adds there."""

    pages: int  # prompt + max_tokens: the pages it may take
    prefill_pages: int  # prompt pages the index predicted it computes; 0 once it decodes
    decoding: bool = False  # its first token came back


@dataclass(frozen=True)
class Load:
    """What the router has open on a worker (the policy's input)."""

    prefill_pages: int = 0  # pages its open requests still have to prefill (predicted)
    decoding: int = 0  # its open requests past their first token
    active_pages: int = 0  # pages (prompt + max_tokens) of all its open requests


@dataclass
class Worker:
    url: str
    role: str  # "both" | "prefill" | "decode"
    healthy: bool = False
    in_flight: int = 0  # requests the router has open on it
    active_pages: int = 0  # pages (prompt + max_tokens) of those requests
    prefill_pages: int = 0  # predicted pages those requests have still to prefill
    decoding: int = 0  # those requests past their first token
    routed: int = 0
    predicted_hit_tokens: int = 0  # what the index said it held of the prompts routed to it
    pending_hit_tokens: int = 0  # the part of those that was pending (routed, no event yet)
    reported_hit_tokens: int = 0  # what its responses said they hit (usage cached_tokens)
    connect_failures: int = 0
    pool_waits: int = 0  # requests held until the shared pool had pages a peer computed
    pool_wait_timeouts: int = 0  # of those, sent before the pool had them all
    # The KV event subscription (``events.py``):
    synced: bool = False  # the index holds its snapshot and the events after it
    seq: int = 0
    event_resets: int = 0
    model_identity: str | None = None  # from its snapshot: the root of its page hashes
    page_size: int | None = None
    cache_pages: int | None = None  # from its snapshot: the pages its device pool can hold
    pool_id: str | None = None  # from its snapshot: the shared KV pool it uses (None: none)

    @property
    def load(self) -> Load:
        return Load(self.prefill_pages, self.decoding, self.active_pages)

    def begin(self, r: Routed) -> None:
        self.in_flight += 1
        self.active_pages += r.pages
        self.prefill_pages += r.prefill_pages

    def first_token(self, r: Routed) -> None:
        if not r.decoding:
            self.prefill_pages -= r.prefill_pages
            self.decoding += 1
            r.prefill_pages, r.decoding = 0, True

    def loads(self, r: Routed, pages: int) -> None:
        """``pages`` of ``r``'s predicted prefill (a peer's, awaited) are in the pool now."""
        pages = min(pages, r.prefill_pages)
        self.prefill_pages -= pages
        r.prefill_pages -= pages

    def end(self, r: Routed) -> None:
        self.in_flight -= 1
        self.active_pages -= r.pages
        self.prefill_pages -= r.prefill_pages
        self.decoding -= r.decoding


class WorkerPool:
    def __init__(self, workers: list[Worker], index: PrefixIndex, interval_s: float,
                 api_key: str | None = None) -> None:
        self.workers = workers
        # headers of the router's own calls (KV events, snapshots); /health needs no key
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.by_url = {w.url: w for w in workers}
        self.index = index
        self.interval_s = interval_s

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.healthy and w.role == role]

    def mark_down(self, w: Worker, why: str) -> None:
        if w.healthy:
            log.warning("worker %s left rotation: %s", w.url, why)
        w.healthy = False
        w.synced = False
        self.index.drop(w.url)

    async def check(self, client: httpx.AsyncClient, w: Worker) -> None:
        try:
            r = await client.get(w.url + "/health", timeout=max(2.0, self.interval_s))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok and not w.healthy:
            log.info("worker %s is in rotation", w.url)
            w.healthy = True
        elif not ok:
            self.mark_down(w, why)

    async def health_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self.check(client, w) for w in self.workers))
            await asyncio.sleep(self.interval_s)
