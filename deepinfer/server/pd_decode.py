"""The decode worker's side of a prefill/decode hand-over (``pd.py`` is the prefill worker's).

A request handed over by a prefill worker carries its counts in ``PREFILL_HEADER``
(``prefill_counts``; they come back in its usage as ``prefill_worker``) and, on the direct
route (``--pd-transfer direct``), the descriptor of its exported pages in ``TRANSFER_HEADER``.
``DecodeWorker.receive`` reads their manifest, then only the pages this worker's tree lacks
(those it holds, earlier turns of the conversation, never cross the link), into its arena
(``kv/transfer_import.py``) before the request is queued, so its lookup finds them as L3
pages, and tells the prefill worker to free them. When this worker has no transfer engine, or
the read fails or takes longer than ``--pd-transfer-timeout``, the request takes the store
route instead: a warning (one per kind per 10 s), a count in
``pd_transfer_fallbacks_by_reason_total``, and its pages come from the store, or are computed;
never an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter

import httpx
from fastapi import Request

from ..kv.cache_manager import KVCacheManager
from ..kv.transfer import Arena, TransferDescriptor, TransferError, open_link
from ..kv.transfer_import import PagePuller, PulledRun, StagedPages
from ..log_limit import RateLimitedLog
from .api_error import APIError
from .async_engine import AsyncEngine
from .config import ServerConfig

log = logging.getLogger("deepinfer.server")
PREFILL_HEADER = "x-deepinfer-prefill"
TRANSFER_HEADER = "x-deepinfer-kv-transfer"
# the prefill's counts a decode worker accepts in ``PREFILL_HEADER`` (all numbers >= 0)
PREFILL_FIELDS = ("prompt_tokens", "cached_tokens", "computed_tokens", "pages", "pages_present",
                  "pages_published", "pages_failed", "pages_exported", "prefill_s", "publish_s")




def prefill_counts(request: Request) -> dict[str, int | float] | None:
    """The prefill worker's counts a request carries (``PREFILL_HEADER``), else None; 400 if
    malformed."""
    raw = request.headers.get(PREFILL_HEADER)
    if raw is None:
        return None
    try:
        v = json.loads(raw)
    except ValueError:
        v = None
    ok = isinstance(v, dict) and all(
        isinstance(v.get(k), (int, float)) and not isinstance(v.get(k), bool) and v[k] >= 0
        for k in PREFILL_FIELDS)
    if not ok:
        raise APIError(400, f"header {PREFILL_HEADER}: must be a JSON object with numbers >= 0 "
                            f"for {', '.join(PREFILL_FIELDS)}", param=PREFILL_HEADER)
    return {k: v[k] for k in PREFILL_FIELDS}


class DecodeWorker:
    """Receives the pages of requests handed over on the direct route (see the module doc);
    idle unless this server runs ``--role decode --pd-transfer direct``."""

    def __init__(self, async_engine: AsyncEngine, config: ServerConfig) -> None:
        self.async_engine = async_engine
        self.config = config
        self.puller: PagePuller | None = None
        self.staged: StagedPages | None = None
        self.fallbacks: Counter[str] = Counter()
        self._log = RateLimitedLog(log)
        self._client: httpx.AsyncClient | None = None
        self._releases: set[asyncio.Task] = set()
        self.direct = config.role == "decode" and config.pd_transfer == "direct"
        tiers = async_engine.engine.tiers
        if not self.direct or tiers is None or tiers.store is None or tiers.remote is None:
            return
        link = open_link(config.pd_transfer_host, config.pd_transfer_protocol,
                         config.pd_transfer_device)
        if link is None:
            return
        arena = Arena(link, config.pd_transfer_buffer_mb << 20)
        self.staged = StagedPages(tiers.store, tiers.remote.format, arena, config.pd_transfer_ttl_s)
        tiers.put_in_front(self.staged)
        self.puller = PagePuller(link, self.staged)

    async def receive(self, request: Request) -> dict[str, int | float] | None:
        """The prefill worker's counts ``request`` carries (``prefill_counts``); with a
        descriptor, the pages this worker lacks pulled first, and ``pages_pulled``,
        ``pages_held`` (the leading pages its tree had, not pulled) and ``pull_s`` added (400
        if the descriptor is malformed)."""
        counts = prefill_counts(request)
        raw = request.headers.get(TRANSFER_HEADER)
        if raw is None:
            return counts
        try:
            d = TransferDescriptor.from_dict(json.loads(raw))
        except ValueError as e:
            raise APIError(400, f"header {TRANSFER_HEADER}: {e}", param=TRANSFER_HEADER) from None
        pages, held, seconds = 0, 0, 0.0
        if self.puller is None:
            self._fallback("no_transfer_engine", "no transfer engine here (start with "
                           "--role decode --pd-transfer direct)")
        else:
            assert self.staged is not None
            run = await self._pull(d)
            if run is not None:
                pages = self.staged.stage(run)
                held, seconds = run.held, run.seconds
        self._release(d)  # (a decode worker without a transfer engine frees it too)
        return {**(counts or {}), "pages_pulled": pages, "pages_held": held,
                "pull_s": round(seconds, 6)}

    async def _pull(self, d: TransferDescriptor) -> PulledRun | None:
        """The pages of ``d`` this worker lacks, read and checked; None (counted) if they
        cannot be."""
        abandoned = threading.Event()
        task = asyncio.ensure_future(self._fetch(d, abandoned))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.config.pd_transfer_timeout_s)
        except TransferError as e:
            self._fallback("transfer_failed", str(e))
        except asyncio.TimeoutError:
            abandoned.set()
            task.add_done_callback(self._discard)
            self._fallback("timeout", f"no answer in {self.config.pd_transfer_timeout_s} s")
        return None

    async def _fetch(self, d: TransferDescriptor, abandoned: threading.Event) -> PulledRun:
        """The manifest, the leading pages the tree holds counted, then the rest read."""
        assert self.puller is not None
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        manifest = await loop.run_in_executor(None, self.puller.manifest, d)
        kv = self.async_engine.engine.kv
        held = await self.async_engine.call(lambda: _in_tree(kv, manifest.hashes))
        run = await loop.run_in_executor(None, self.puller.pull, d, manifest, held, abandoned)
        run.seconds = time.perf_counter() - t0
        return run

    def _discard(self, fut: asyncio.Future) -> None:
        """A pull given up on that finished anyway: free its range."""
        if not fut.cancelled() and fut.exception() is None and self.staged is not None:
            run = fut.result()
            if run.nbytes:
                self.staged.arena.free(run.offset, run.nbytes)

    def _fallback(self, reason: str, why: str) -> None:
        self.fallbacks[reason] += 1
        self._log.warning(reason, "direct KV transfer: %s; the request takes the store route",
                          why)

    def _release(self, d: TransferDescriptor) -> None:
        """Tell the prefill worker to free the pages (in the background; its TTL frees them
        if this never arrives)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        task = asyncio.create_task(self._post_release(d))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _post_release(self, d: TransferDescriptor) -> None:
        assert self._client is not None
        try:
            await self._client.post(d.release_url, json={"transfer_id": d.transfer_id})
        except httpx.HTTPError as e:
            self._log.warning("release", "releasing transfer %s at %s: %s", d.transfer_id,
                              d.release_url, e)

    def stats(self) -> dict[str, int | dict[str, int]]:
        """Counters for /metrics (none unless on the direct route)."""
        if not self.direct:
            return {}
        staged = self.staged.staged_stats() if self.staged is not None else {}
        return {**{f"pd_transfer_{k}_total": v for k, v in staged.items() if k != "staged_pages"},
                "pd_transfer_staged_pages": staged.get("staged_pages", 0),
                "pd_transfer_fallbacks_by_reason_total": dict(self.fallbacks)}

    async def close(self) -> None:
        if self.staged is not None:
            self.staged.arena.close()
        if self._client is not None:
            await self._client.aclose()


def _in_tree(kv: KVCacheManager, hashes: list[bytes]) -> int:
    """How many leading pages of ``hashes`` the tree holds (any tier): a lookup loads those
    from this worker's own tiers (engine thread)."""
    if kv.tree is None:
        return 0
    return kv.tree.match(hashes, touch=False, count_hit=False).num_pages
