"""Prefill/decode disaggregation, DualPath style: the KV reaches the decode worker from the
shared store (``--kv-store``), never through the client.

* ``--role prefill``: ``POST /internal/prefill`` computes a request's prompt (chunked prefill,
  radix cache and store hits as usual, nothing sampled: ``SamplingParams.prefill_only``), makes
  every full page of it durable in the store (``kv/publish.py``: the pages the store lacked are
  waited for or written, and acknowledged) and answers with the counts. With
  ``--decode-worker URL`` (repeatable, round-robin) the public endpoints do that, then forward
  the original request to a decode worker and pass its answer back unchanged, streamed or not
  (a client that leaves closes the forwarded request, which aborts it there). Without one,
  they answer 400: a prefill worker never decodes.
* ``--role decode``: a plain server whose hits come from the store. The prefill's counts reach
  it in the ``x-deepinfer-prefill`` header (the JSON of ``/internal/prefill``'s answer) and
  come back in its usage as ``prefill_worker``.
* ``--role both`` (default): co-located, none of this.

``--pd-transfer`` picks how the pages reach the decode worker. ``store`` (default): as above,
published to the store, loaded from it. ``direct``: the prefill worker does not publish them; it
keeps them in its transfer engine's buffer (``kv/transfer_export.py``) and hands over their
descriptor (``transfer`` in the counts; ``TRANSFER_HEADER`` when forwarding), which the decode
worker reads them with (``pd_decode.py``) and then releases. Where it cannot export them (no
transfer engine, buffer full) the prefill worker publishes them as on the store route, and
counts why (``pd_transfer_fallbacks_by_reason_total``).

The tail partial page of a prompt is never published: the decode worker computes it (and at
least the prompt's last token, whose logits start its reply).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Protocol, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import EngineConfig
from ..engine import LLMEngine
from ..kv.publish import PagePlan, PublishResult, StorePublisher
from ..kv.transfer import TransferDescriptor, open_link
from ..kv.transfer_export import PageExporter
from ..log_limit import RateLimitedLog
from .anthropic import parse_messages_request
from .boundary import read_json
from .async_engine import AsyncEngine
from .api_error import APIError
from .config import ServerConfig
from .outputs import Delta, Submission
from .pd_decode import PREFILL_FIELDS, PREFILL_HEADER, TRANSFER_HEADER
from .protocol import ParsedRequest, parse_request
from .request_fields import get_str

log = logging.getLogger("deepinfer.server")
T = TypeVar("T")

# the endpoint of each kind of request (``/internal/prefill``'s "endpoint" field)
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
         "messages": "/v1/messages"}
# response headers of a decode worker passed back to the client
PASSED_HEADERS = ("content-type", "x-request-id", "x-deepinfer-prompt-encoding",
                  "x-deepinfer-history-rewritten", "retry-after")


def check_role(config: ServerConfig, engine_config: EngineConfig) -> None:
    """The roles' requirements, at start-up (ValueError)."""
    if config.role != "both" and engine_config.kv_store is None:
        raise ValueError(f"--role {config.role} needs the shared store: --kv-store URL")


class Server(Protocol):
    """What a prefill worker uses of the app's ``Server`` (``app.py``)."""

    engine: LLMEngine
    async_engine: AsyncEngine
    config: ServerConfig
    defaults: dict

    def check_model(self, model: str | None) -> None: ...

    def watch_disconnect(self, request: Request, q: asyncio.Queue, rid: str
                         ) -> Coroutine[None, None, None]: ...

    async def next_delta(self, q: asyncio.Queue, merge: bool = True) -> Delta | None: ...


class PrefillWorker:
    """``--role prefill``: the internal endpoint and, with decode workers, the forwarder."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.async_engine = server.async_engine
        self.publisher = StorePublisher(server.engine.kv, server.engine.tiers)
        c = server.config
        self.direct = c.pd_transfer == "direct"
        self.exporter: PageExporter | None = None
        link = open_link(c.pd_transfer_host, c.pd_transfer_protocol, c.pd_transfer_device) \
            if self.direct else None
        if link is not None:
            self.exporter = PageExporter(server.engine.kv, self.publisher.tiers, link,
                                         c.pd_transfer_buffer_mb << 20, c.pd_transfer_ttl_s)
        self.fallbacks: Counter[str] = Counter()  # direct route: exports not made, by reason
        self._log = RateLimitedLog(log)
        self.decode_workers = [u.rstrip("/") for u in server.config.decode_workers]
        self._turn = itertools.count()
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ prefill
    def _parse(self, kind: str, body: dict) -> ParsedRequest:
        defaults = self.server.defaults
        parsed = parse_messages_request(body, defaults) if kind == "messages" else \
            parse_request(body, kind, defaults)
        self.server.check_model(parsed.model)
        params = dataclasses.replace(parsed.params, max_tokens=1, n=1, best_of=None,
                                     logprobs=None, structured_output=None, prefill_only=True)
        return dataclasses.replace(parsed, params=params, max_tokens=1, stream=False)

    async def prefill(self, kind: str, body: dict, request: Request) -> dict | None:
        """Compute ``body``'s prompt and publish its full pages; the counts (see
        docs/server.md), None if the caller left."""
        parsed = self._parse(kind, body)
        ae, pub = self.async_engine, self.publisher

        def build():
            built = ae.build_prompt(parsed)
            return built, pub.plan(built.token_ids, parsed.cache_salt)

        built, plan = await ae.call(build)
        # the direct route does not publish (its fallback counts every page as missing)
        before = ([False] * len(plan.keys) if self.direct
                  else await asyncio.to_thread(pub.in_store, plan.keys))
        t0 = time.perf_counter()
        rid = f"prefill-{uuid.uuid4().hex}"
        sub = Submission(rid, parsed, prompt=built)
        _, q = await ae.submit(sub)
        watcher = asyncio.create_task(self.server.watch_disconnect(request, q, rid))
        try:
            d = await self.server.next_delta(q)
        finally:
            watcher.cancel()
        if d is None:  # the caller left (the request was aborted)
            return None
        if d.error or d.usage is None:
            raise APIError(500, d.error or "prefill ended without usage", type="server_error")
        usage = d.usage
        t1 = time.perf_counter()
        sent = await self._export(plan, str(request.base_url)) if self.direct else None
        result = (PublishResult(len(plan.keys), 0, 0, len(plan.keys) - sent.pages) if sent
                  else await self._publish(plan, before))
        return {"id": rid, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "cached_tokens_by_tier": dict(usage.cached_tokens_by_tier),
                "computed_tokens": usage.prompt_tokens - usage.cached_tokens,
                **result.to_dict(), "pages_exported": sent.pages if sent else 0,
                "prefill_s": round(t1 - t0, 6), "publish_s": round(time.perf_counter() - t1, 6),
                "kv_store": pub.remote.where, "transfer": sent.to_dict() if sent else None}

    async def _export(self, plan: PagePlan, base_url: str) -> TransferDescriptor | None:
        """The direct route: the plan's pages kept for the decode worker; None (counted) if
        they cannot be, and then the caller publishes them."""
        if not plan.keys:
            return None  # no full page: nothing to hand over
        exporter = self.exporter
        if exporter is None:
            return self._fallback("no_transfer_engine")
        stage = await self.async_engine.call(lambda: exporter.capture(plan))
        if stage is None:
            return self._fallback("pages_evicted")
        sent = await asyncio.to_thread(stage, base_url + "internal/release")
        return sent or self._fallback("buffer_full")

    def _fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1
        self._log.warning(reason, "direct KV transfer: cannot export a prompt's pages (%s); "
                                  "publishing them to the store instead", reason)

    async def release(self, request: Request) -> Response:
        """``POST /internal/release``: {"transfer_id": ID}, from a decode worker that has read
        the pages of that export."""
        body = await read_json(request, self.server.config.max_body_bytes)
        tid = get_str(body, "transfer_id")
        if tid is None:
            raise APIError(400, "transfer_id: required", param="transfer_id")
        return JSONResponse({"released": self.exporter is not None and self.exporter.release(tid)})

    def stats(self) -> dict[str, int | dict[str, int]]:
        """Counters for /metrics (none on the store route)."""
        if not self.direct:
            return {}
        e = self.exporter.stats() if self.exporter is not None else {}
        counters = {f"pd_transfer_{k}_total": v for k, v in e.items()
                    if k not in ("live", "free_bytes")}
        return {**counters, "pd_transfer_live_exports": e.get("live", 0),
                "pd_transfer_free_bytes": e.get("free_bytes", 0),
                "pd_transfer_fallbacks_by_reason_total": dict(self.fallbacks)}

    async def _publish(self, plan: PagePlan, before: list[bool]) -> PublishResult:
        pub = self.publisher
        missing = [i for i, ok in enumerate(before) if not ok]
        if missing:  # the write-through of this prefill: wait for it, then look again
            keys = [plan.keys[i] for i in missing]
            await asyncio.to_thread(pub.wait_written, keys)
            found = await asyncio.to_thread(pub.in_store, keys)
            still = [i for i, ok in zip(missing, found) if not ok]
        else:
            still = []
        written = 0
        if still:
            put = await self.async_engine.call(lambda: pub.capture(plan, still))
            if put is not None:
                written = sum(await asyncio.to_thread(put))
        return PublishResult(pages=len(plan.keys), pages_present=len(plan.keys) - len(missing),
                             pages_published=len(missing) - len(still) + written,
                             pages_failed=len(still) - written)

    async def internal(self, request: Request) -> Response:
        """``POST /internal/prefill``: {"endpoint": "chat" | "completion" | "messages",
        "request": BODY}."""
        body = await read_json(request, self.server.config.max_body_bytes)
        kind = get_str(body, "endpoint")
        if kind not in PATHS:
            raise APIError(400, f"endpoint: must be one of {', '.join(PATHS)}", param="endpoint")
        inner = body.get("request")
        if not isinstance(inner, dict):
            raise APIError(400, "request: must be the JSON body of the endpoint's request",
                           param="request")
        counts = await self.prefill(kind, inner, request)
        return Response(status_code=499) if counts is None else JSONResponse(counts)

    # ------------------------------------------------------------------ forwarding
    async def public(self, request: Request, kind: str) -> Response:
        """A public endpoint of a prefill worker: prefill, then the decode worker's answer."""
        if not self.decode_workers:
            raise APIError(400, "this server runs --role prefill: it computes prompts only "
                                "(POST /internal/prefill); start it with --decode-worker URL "
                                "to serve this endpoint", code="prefill_only")
        body = await read_json(request, self.server.config.max_body_bytes)
        counts = await self.prefill(kind, body, request)
        if counts is None:
            return Response(status_code=499)
        headers = {"content-type": "application/json",
                   PREFILL_HEADER: json.dumps({k: counts[k] for k in PREFILL_FIELDS})}
        if counts["transfer"] is not None:
            headers[TRANSFER_HEADER] = json.dumps(counts["transfer"])
        for h in ("authorization", "x-api-key", "anthropic-version"):
            if h in request.headers:
                headers[h] = request.headers[h]
        resp = await self._send(PATHS[kind], json.dumps(body).encode(), headers, request)
        if resp is None:
            return Response(status_code=499)
        passed = {h: resp.headers[h] for h in PASSED_HEADERS if h in resp.headers}
        if not body.get("stream"):
            return Response(await resp.aread(), status_code=resp.status_code, headers=passed)
        return StreamingResponse(self._relay(resp), status_code=resp.status_code, headers=passed)

    async def _relay(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The decode worker's stream as it comes; closing it (the client left) closes the
        connection, which aborts the request there."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    async def _send(self, path: str, content: bytes, headers: dict[str, str],
                    request: Request) -> httpx.Response | None:
        """POST to the next decode worker that answers (round-robin); its response, headers
        read, body not yet. None if the client left meanwhile; 502 if no worker answers."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        start = next(self._turn)
        errors = []
        for k in range(len(self.decode_workers)):
            url = self.decode_workers[(start + k) % len(self.decode_workers)] + path
            req = self._client.build_request("POST", url, content=content, headers=headers)
            try:
                return await _unless_disconnected(request, self._client.send(req, stream=True))
            except asyncio.CancelledError:
                return None
            except httpx.TransportError as e:
                log.warning("decode worker %s: %s", url, e)
                errors.append(f"{url}: {type(e).__name__}")
        raise APIError(502, f"no decode worker answered ({'; '.join(errors)})",
                       type="server_error", code="decode_worker_unavailable")

    async def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        if self._client is not None:
            await self._client.aclose()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, or CancelledError (``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(gone())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        raise asyncio.CancelledError
    return task.result()
