"""The worker's KV event stream: which pages (chained hashes) entered or left which tier.

A router keeps a global prefix index from these events (as vLLM's ``--kv-events-config`` and
Dynamo's KV router do). The radix tree tells ``KVEventLog`` (its ``TreeListener``) on the
engine thread; the log only appends to a bounded buffer under a lock, so a slow or absent
subscriber never holds the engine up. Every event has a sequence number; a subscriber asks
for the events after the last one it saw. One that fell behind the buffer (or asks about a
sequence this process never reached, e.g. after a restart) gets ``reset`` and rebuilds from
the snapshot, which is taken on the engine thread and so is an exact cut of the stream.

Endpoints: ``GET /kv/events?since=N&wait=S`` (long poll: answers as soon as there is an
event after N, or after S seconds with none) and ``GET /kv/snapshot`` (every page held, per
tier, the sequence number it is current to, what a router needs to hash prompts the same way:
the model identity and the page size, and ``cache_pages``, how many pages the device pool
holds, so a router can tell from the device events how full it is; ``pool_id``, a digest of
its ``--kv-store`` URL, None without one: workers with the same id share one KV pool, whose
pages they report as their L3 tier, so a router counts those pages as loadable by all of them).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..kv.radix import DISK, TIER_NAMES, RadixTree
from .api_error import APIError
from .async_engine import AsyncEngine

MAX_WAIT_S = 30.0
_POLL_S = 0.02  # how often a long poll looks for new events


@dataclass(frozen=True)
class KVEvent:
    seq: int
    stored: bool  # False: removed
    tier: int
    hashes: tuple[bytes, ...]

    def to_dict(self) -> dict:
        return {"seq": self.seq, "type": "stored" if self.stored else "removed",
                "tier": TIER_NAMES[self.tier], "hashes": [h.hex() for h in self.hashes]}


class KVEventLog:
    """Bounded, numbered buffer of the tree's events (the ``TreeListener`` of one tree).

    ``writing(hashes)`` (the tier backend's): whether L3 writes of those pages are still
    queued. The tree records L3 when a write is queued, but a peer sharing the KV pool can only
    load a page once it is there, so an L3 "stored" event waits until its writes land."""

    def __init__(self, max_events: int = 4096,
                 writing: Callable[[list[bytes]], bool] | None = None) -> None:
        self.max_events = max_events
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self.seq = 0  # the last event's number (0: none yet)
        self._writing = writing
        self._unwritten: list[list[bytes]] = []  # L3 stored events whose writes are queued

    def _add(self, stored: bool, hashes: Sequence[bytes], tier: int) -> None:
        with self._lock:
            self._append(stored, hashes, tier)

    def _append(self, stored: bool, hashes: Sequence[bytes], tier: int) -> None:
        self.seq += 1
        self._events.append(KVEvent(self.seq, stored, tier, tuple(hashes)))

    def stored(self, hashes: list[bytes], tier: int) -> None:
        if tier == DISK and self._writing is not None and self._writing(hashes):
            with self._lock:
                self._unwritten.append(list(hashes))
            return
        self._add(True, hashes, tier)

    def removed(self, hashes: list[bytes], tier: int) -> None:
        if tier == DISK:
            gone = set(hashes)
            with self._lock:
                self._unwritten = [[h for h in e if h not in gone] for e in self._unwritten]
        self._add(False, hashes, tier)

    def _landed(self) -> None:
        """Publish the L3 stored events whose writes landed."""
        assert self._writing is not None
        with self._lock:
            still = []
            for hashes in filter(None, self._unwritten):
                if self._writing(hashes):
                    still.append(hashes)
                else:
                    self._append(True, hashes, DISK)
            self._unwritten = still

    def since(self, seq: int) -> tuple[list[KVEvent], bool]:
        """(events after ``seq``, reset): reset is True when some of them are no longer held
        or ``seq`` is ahead of this log; the caller must then resync from the snapshot."""
        if self._unwritten:
            self._landed()
        with self._lock:
            if seq > self.seq or (self._events and seq < self._events[0].seq - 1):
                return [], True
            if seq == self.seq:
                return [], False
            start = seq - self._events[0].seq + 1
            return list(itertools.islice(self._events, start, None)), False

    async def wait(self, seq: int, timeout: float) -> tuple[list[KVEvent], bool]:
        deadline = time.monotonic() + timeout
        while True:
            events, reset = self.since(seq)
            if events or reset or time.monotonic() >= deadline:
                return events, reset
            await asyncio.sleep(_POLL_S)


def attach_event_log(tree: RadixTree | None, max_events: int,
                     writing: Callable[[list[bytes]], bool] | None = None) -> KVEventLog | None:
    """The event log of ``tree`` (None without a prefix cache, or ``max_events`` 0)."""
    if tree is None or max_events == 0:
        return None
    log = KVEventLog(max_events, writing)
    tree.listener = log
    return log


def _snapshot(aeng: AsyncEngine, log: KVEventLog) -> dict:
    """Run on the engine thread: no event can land between the walk and ``log.seq``."""
    kv = aeng.engine.kv
    assert kv.tree is not None
    by_tier: dict[str, list[str]] = {name: [] for name in TIER_NAMES}
    for h, t in kv.tree.held_pages():
        by_tier[TIER_NAMES[t]].append(h.hex())
    return {"seq": log.seq, "page_size": kv.page_size, "model_identity": kv.model_identity,
            "cache_pages": kv.allocator.num_pages - 1,  # page 0 is padding, never handed out
            "pool_id": pool_id(aeng.engine.config.kv_store), "pages": by_tier}


def pool_id(kv_store: str | None) -> str | None:
    """Who shares a KV pool, without telling the store's address (it may hold a password)."""
    return None if kv_store is None else hashlib.sha256(kv_store.encode()).hexdigest()[:16]


def add_kv_event_routes(app: FastAPI, aeng: AsyncEngine, log: KVEventLog | None) -> None:
    def need_log() -> KVEventLog:
        if log is None:
            raise APIError(404, "this server has no prefix cache, so no KV events",
                           type="not_found_error")
        return log

    @app.get("/kv/events")
    async def kv_events(request: Request) -> JSONResponse:
        lg = need_log()
        try:
            since = int(request.query_params.get("since", "0"))
            wait = float(request.query_params.get("wait", "0"))
        except ValueError:
            raise APIError(400, "since must be an integer, wait a number of seconds",
                           param="since") from None
        if since < 0 or not 0 <= wait <= MAX_WAIT_S:
            raise APIError(400, f"since must be >= 0 and wait in [0, {MAX_WAIT_S}]",
                           param="since" if since < 0 else "wait")
        events, reset = await lg.wait(since, wait)
        last = events[-1].seq if events else (lg.seq if reset else since)
        return JSONResponse({"seq": last, "reset": reset,
                             "events": [e.to_dict() for e in events]})

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> JSONResponse:
        lg = need_log()
        return JSONResponse(await aeng.call(lambda: _snapshot(aeng, lg)))
