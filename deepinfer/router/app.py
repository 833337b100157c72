"""The router's FastAPI app: OpenAI-compatible front over a set of ``deepinfer serve`` workers.

``POST /v1/chat/completions``, ``/v1/completions`` and Anthropic's ``/v1/messages`` are read
with the server's own parsers (a bad request is answered 400 here), hashed (``prompts.py``),
given a worker by the policy (``policy.py``), left pending on it in the index, and forwarded;
the answer comes back unchanged (``proxy.py``) with an ``x-deepinfer-worker`` header naming
the worker. A worker that refuses the connection leaves
rotation and the request goes to the next best one. ``GET /v1/models`` is a healthy worker's;
``GET /health`` is 200 while some worker is in rotation; ``GET /metrics`` and
``GET /router/workers`` show the routing. With ``--prefill-worker``/``--decode-worker`` each
request is prefilled on one worker and decoded on another (``pd.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..server.boundary import CatchAll, read_json
from ..server.anthropic import error_response, parse_messages_request
from ..server.api_error import APIError
from ..server.protocol import parse_request
from .config import RouterConfig
from .events import follow
from .index import PrefixIndex
from . import pd
from .metrics import render
from .policy import Choice, CostWeights, Policy, pool_peers
from .pool_wait import PoolWaits
from .prompts import PromptTokenizer, RoutedPrompt
from .proxy import (StreamSniffer, cached_tokens, passed_headers, streamed,
                    unless_disconnected, whole)
from .workers import Routed, Worker, WorkerPool

log = logging.getLogger("deepinfer.router")
# one line per pick at INFO: the worker, its predicted hit, each candidate's cost and load
placement_log = logging.getLogger("deepinfer.router.placement")

T = TypeVar("T")
MAX_BODY_BYTES = 16 * 2**20
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)  # nothing reached the worker
# a client's headers passed on to the worker (its key, Anthropic's version header)
_CLIENT_HEADERS = ("authorization", "x-api-key", "anthropic-version")


class Router:
    def __init__(self, config: RouterConfig, tokenizer) -> None:
        self.config = config
        self.index = PrefixIndex(config.pending_ttl_s)
        roles = [(u, "both") for u in config.workers] + \
            [(u, "prefill") for u in config.prefill_workers] + \
            [(u, "decode") for u in config.decode_workers]
        self.pool = WorkerPool([Worker(u, r) for u, r in roles], self.index,
                               config.health_interval_s, config.worker_api_key)
        self.policy = Policy(config.policy, self.index,
                             CostWeights(**{f.name: getattr(config, f.name)
                                            for f in fields(CostWeights)}),
                             pool_waits=config.pool_wait_s > 0 and not config.disaggregated)
        self.waits = PoolWaits(self.index, config.pool_wait_s)
        self.tokens = PromptTokenizer(tokenizer)
        self.client: httpx.AsyncClient | None = None
        self.retries = 0

    # ------------------------------------------------------------------ routing
    def pick(self, prompt: RoutedPrompt, role: str, tried: set[str]) -> Choice:
        workers = [w for w in self.pool.healthy(role) if w.url not in tried]
        if not workers:
            which = "" if role == "both" else f"{role} "
            raise APIError(503, f"no {which}worker is in rotation (all failed their health "
                                "checks or refused the connection)",
                           type="server_error", code="no_worker")
        choice = self.policy.pick(workers, prompt, use_cache=role != "decode")
        if placement_log.isEnabledFor(logging.INFO):  # what benchmarks/router.py reads
            placement_log.info("placement %s", json.dumps({
                "role": role, "worker": choice.worker.url, "prompt_tokens": prompt.num_tokens,
                "hit_pages": choice.overlap.pages, "pooled_pages": choice.overlap.pooled,
                "costs": choice.costs,
                "sticky": choice.sticky, "awaits": choice.awaits,
                "loads": {w.url: [w.prefill_pages, w.decoding, self.policy.free_pages(w)]
                          for w in workers}}))
        return choice

    def route(self, choice: Choice, prompt: RoutedPrompt, cached: bool) -> Routed:
        """The load ``prompt`` adds on the chosen worker; ``cached`` (it computes the prompt
        there): its pages become pending there, so the next request sharing them follows, and
        its conversation's next turn finds it there."""
        w = choice.worker
        hit = choice.overlap.pages + choice.overlap.pooled
        to_prefill = prompt.prompt_pages(w.page_size) - hit if cached else 0
        r = Routed(prompt.pages(w.page_size), to_prefill)
        w.begin(r)
        if cached and w.synced and w.model_identity is not None and w.page_size is not None:
            hashes = prompt.page_hashes(w.model_identity, w.page_size)
            self.index.add_pending(w.url, hashes)
            self.policy.conversations.record(hashes, w.url)
            self.waits.hold(w.url, hashes[choice.awaited_pages - choice.awaits:
                                          choice.awaited_pages])
        return r

    async def await_pool(self, choice: Choice, prompt: RoutedPrompt, r: Routed) -> None:
        """Hold the request until the pool has the pages it awaits, or those another request
        awaits on its worker (``pool_wait.py``); then it loads what it awaited."""
        w = choice.worker
        if w.model_identity is None or w.page_size is None:
            return
        hashes = prompt.page_hashes(w.model_identity, w.page_size)
        n = max(choice.awaited_pages, self.waits.reach(w.url, hashes))
        if not n:
            return
        w.pool_waits += 1
        peers = pool_peers(self.pool.healthy(w.role))[w.url]
        t0 = time.monotonic()
        try:
            ok = await self.waits.wait(w.url, peers, hashes[:n])
            w.pool_wait_timeouts += not ok
            placement_log.info("pool wait %s", json.dumps({
                "worker": w.url, "pages": n, "seconds": round(time.monotonic() - t0, 3),
                "complete": ok}))
        finally:
            end = choice.awaited_pages
            self.waits.release(w.url, hashes[end - choice.awaits:end])
        w.loads(r, choice.awaits)

    def unroute(self, choice: Choice, prompt: RoutedPrompt) -> None:
        """The request failed on the chosen worker: its pages are not coming there."""
        w = choice.worker
        if w.model_identity is not None and w.page_size is not None:
            self.index.forget_pending(w.url, prompt.page_hashes(w.model_identity, w.page_size))

    def counted(self, choice: Choice) -> None:
        w = choice.worker
        w.routed += 1
        w.predicted_hit_tokens += choice.predicted_hit_tokens
        w.pending_hit_tokens += choice.pending_hit_tokens

    async def completion(self, request: Request, kind: str, path: str) -> Response:
        """``kind``: "chat", "completion" or "messages" (Anthropic's, hashed as a chat)."""
        assert self.client is not None
        body = await read_json(request, MAX_BODY_BYTES)
        parsed = parse_messages_request(body) if kind == "messages" else parse_request(body, kind)
        prompt = await self.tokens.prompt(parsed)
        headers = self._headers(request)
        if self.config.disaggregated:
            pre, counts = await self.first_answering("prefill", prompt, lambda choice: self.prefill(
                request, choice, kind, body, prompt, headers))
            if not isinstance(counts, dict):  # the client left, or the prefill failed
                return counts if counts is not None else Response(status_code=499)
            headers = pd.decode_headers(counts, headers, pre.worker.url)
        _, resp = await self.first_answering(
            "decode" if self.config.disaggregated else "both", prompt,
            lambda choice: self.forward(request, choice, path, body, prompt, headers))
        return resp

    async def first_answering(self, role: str, prompt: RoutedPrompt,
                              send: Callable[[Choice], Awaitable[T]]) -> tuple[Choice, T]:
        """(choice, ``await send(choice)``) for the best worker of ``role``; on a connect error
        that worker leaves rotation and the next best one is tried."""
        tried: set[str] = set()
        while True:
            choice = self.pick(prompt, role, tried)
            try:
                return choice, await send(choice)
            except _RETRYABLE as e:
                tried.add(choice.worker.url)
                choice.worker.connect_failures += 1
                self.pool.mark_down(choice.worker, f"{type(e).__name__}: {e}")
                self.retries += 1

    async def prefill(self, request: Request, choice: Choice, kind: str, body: dict,
                      prompt: RoutedPrompt, headers: dict[str, str]) -> dict | Response | None:
        """PD: the prefill worker's counts; its answer itself if it is not a 200; None if the
        client left."""
        assert self.client is not None
        w = choice.worker
        routed = self.route(choice, prompt, cached=True)
        resp = None
        try:
            resp = await pd.prefill(self.client, request, w.url, kind, body, headers)
        finally:
            w.end(routed)
            if resp is None or resp.status_code != 200:
                self.unroute(choice, prompt)
        if resp is None:
            return None
        self.counted(choice)
        if resp.status_code != 200:
            return pd.failed(resp, w.url)
        counts = resp.json()
        w.reported_hit_tokens += int(counts.get("cached_tokens") or 0)
        return counts

    def _headers(self, request: Request) -> dict[str, str]:
        passed = {k: request.headers[k] for k in _CLIENT_HEADERS if k in request.headers}
        return {"content-type": "application/json", **passed}

    async def forward(self, request: Request, choice: Choice, path: str, body: dict,
                      prompt: RoutedPrompt, headers: dict[str, str]) -> Response:
        assert self.client is not None
        w = choice.worker
        routed = self.route(choice, prompt, cached=not self.config.disaggregated)
        handed_off = ok = False
        try:
            await self.await_pool(choice, prompt, routed)
            up = self.client.build_request("POST", w.url + path, headers=headers,
                                           content=json.dumps(body).encode())
            resp = await unless_disconnected(request, asyncio.ensure_future(
                self.client.send(up, stream=True)))
            if resp is None:
                return Response(status_code=499)
            self.counted(choice)
            ok = resp.status_code == 200
            headers = passed_headers(resp, {"x-deepinfer-worker": w.url})
            if prompt.parsed.stream and ok:
                # a chat stream opens with a role chunk per sample, a messages stream with
                # message_start: the first token is in the event after those
                before = prompt.parsed.params.n if prompt.parsed.kind == "chat" else 0
                sniffer = StreamSniffer(before + 1, lambda: w.first_token(routed))

                def on_end() -> None:
                    w.end(routed)
                    w.reported_hit_tokens += sniffer.cached_tokens or 0

                handed_off = True
                return streamed(resp, headers, sniffer, on_end)
            data = await unless_disconnected(request, asyncio.ensure_future(resp.aread()))
            await resp.aclose()
            if data is None:
                return Response(status_code=499)
            if ok:
                w.reported_hit_tokens += cached_tokens(json.loads(data).get("usage")) or 0
            return whole(resp, data, headers)
        finally:
            if not handed_off:
                w.end(routed)
                if not ok:
                    self.unroute(choice, prompt)

    # ------------------------------------------------------------------ other endpoints
    async def models(self, request: Request) -> Response:
        assert self.client is not None
        for w in self.pool.workers:
            if w.healthy and w.role != "prefill":
                try:
                    r = await self.client.get(w.url + "/v1/models",
                                              headers=self._headers(request))
                except httpx.HTTPError:
                    continue
                return whole(r, r.content, passed_headers(r, {}))
        raise APIError(503, "no worker is in rotation", type="server_error", code="no_worker")

    def workers_state(self) -> dict:
        return {"policy": self.policy.name, "workers": [
            {"url": w.url, "role": w.role, "healthy": w.healthy, "synced": w.synced, "seq": w.seq,
             "routed": w.routed, "in_flight": w.in_flight, "active_pages": w.active_pages,
             "prefill_pages": w.prefill_pages, "decoding": w.decoding,
             "index_pages": self.index.num_pages(w.url),
             "device_pages": self.index.device_pages(w.url), "cache_pages": w.cache_pages,
             "pending_pages": self.index.num_pending(w.url),
             "predicted_hit_tokens": w.predicted_hit_tokens,
             "pending_hit_tokens": w.pending_hit_tokens,
             "reported_hit_tokens": w.reported_hit_tokens, "event_resets": w.event_resets,
             "pool_waits": w.pool_waits, "pool_wait_timeouts": w.pool_wait_timeouts}
            for w in self.pool.workers]}

    def metrics(self) -> str:
        return render(self.pool.workers, self.index, self.retries)

    # ------------------------------------------------------------------ app
    def build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            timeout = httpx.Timeout(self.config.request_timeout_s, connect=5.0)
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
            await asyncio.gather(*(self.pool.check(self.client, w) for w in self.pool.workers))
            tasks = [asyncio.create_task(self.pool.health_loop(self.client))] + [
                asyncio.create_task(follow(self.client, self.pool, w, self.config.events_wait_s,
                                           self.waits.changed))
                for w in self.pool.workers]
            yield
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.client.aclose()
            self.tokens.close()

        app = FastAPI(title="DeepInfer router", lifespan=lifespan, docs_url=None,
                      redoc_url=None, openapi_url=None)
        app.state.router = self

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.get("/health")
        async def health() -> Response:
            up = [w.url for w in self.pool.workers if w.healthy]
            return JSONResponse({"status": "ok" if up else "no worker", "workers": up},
                                status_code=200 if up else 503)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.completion(request, "chat", "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, "completion", "/v1/completions")

        @app.post("/v1/messages")
        async def messages(request: Request) -> Response:
            try:
                return await self.completion(request, "messages", "/v1/messages")
            except APIError as e:  # Anthropic's error shape on Anthropic's endpoint
                return error_response(e)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await self.models(request)

        @app.get("/router/workers")
        async def workers() -> dict:
            return self.workers_state()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

        app.add_middleware(CatchAll)
        return app
