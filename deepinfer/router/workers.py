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
class Worker:
    url: str
    role: str  # "both" | "prefill" | "decode"
    healthy: bool = False
    in_flight: int = 0  # requests the router has open on it
    active_pages: int = 0  # pages (prompt + max_tokens) of those requests: its load
    routed: int = 0
    predicted_hit_tokens: int = 0  # what the index said it held of the prompts routed to it
    reported_hit_tokens: int = 0  # what its responses said they hit (usage cached_tokens)
    connect_failures: int = 0
    # The KV event subscription (``events.py``):
    synced: bool = False  # the index holds its snapshot and the events after it
    seq: int = 0
    event_resets: int = 0
    model_identity: str | None = None  # from its snapshot: the root of its page hashes
    page_size: int | None = None

    def begin(self, pages: int) -> None:
        self.in_flight += 1
        self.active_pages += pages

    def end(self, pages: int) -> None:
        self.in_flight -= 1
        self.active_pages -= pages


class WorkerPool:
    def __init__(self, workers: list[Worker], index: PrefixIndex, interval_s: float) -> None:
        self.workers = workers
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
