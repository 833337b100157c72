"""Subscribing to each worker's KV events (``server/kv_events.py``) to keep the index current.

Per worker, one task: take ``/kv/snapshot`` (the pages it holds and the sequence number that
is current to), then long-poll ``/kv/events?since=N`` and apply what comes. A ``reset``
answer (the router fell behind the worker's buffer, or the worker restarted) or a failed poll
means the index no longer knows that worker: it is dropped and rebuilt from a new snapshot.
Both calls carry the router's ``--worker-api-key`` for workers that require one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from .workers import Worker, WorkerPool

log = logging.getLogger("deepinfer.router")


async def sync(client: httpx.AsyncClient, pool: WorkerPool, w: Worker) -> None:
    r = await client.get(w.url + "/kv/snapshot", headers=pool.auth)
    r.raise_for_status()
    snap = r.json()
    pool.index.reset(w.url, snap["pages"])
    w.seq, w.model_identity, w.page_size = snap["seq"], snap["model_identity"], snap["page_size"]
    w.cache_pages, w.pool_id = snap["cache_pages"], snap["pool_id"]
    w.synced = True


async def poll(client: httpx.AsyncClient, pool: WorkerPool, w: Worker, wait_s: float) -> None:
    r = await client.get(w.url + "/kv/events", params={"since": w.seq, "wait": wait_s},
                         headers=pool.auth, timeout=wait_s + 10)
    r.raise_for_status()
    body = r.json()
    if not w.synced:  # the worker left rotation during the poll: its index was dropped
        return
    if body["reset"]:
        w.event_resets += 1
        w.synced = False
        pool.index.drop(w.url)
        return
    pool.index.apply(w.url, body["events"])
    w.seq = body["seq"]


async def follow(client: httpx.AsyncClient, pool: WorkerPool, w: Worker, wait_s: float,
                 changed: Callable[[], Awaitable[None]]) -> None:
    """Keep ``pool.index`` current for ``w`` while it is healthy (runs until cancelled);
    ``changed()`` after each update (requests waiting on the index look again)."""
    while True:
        if not w.healthy:
            await asyncio.sleep(pool.interval_s / 4)
            continue
        try:
            if not w.synced:
                await sync(client, pool, w)
                await changed()
            await poll(client, pool, w, wait_s)
            await changed()
        except (httpx.HTTPError, ValueError, KeyError) as e:
            if w.synced:
                log.warning("KV events of %s lost (%s); resyncing", w.url, e)
            w.synced = False
            pool.index.drop(w.url)
            await asyncio.sleep(pool.interval_s)
