"""FastAPI app: OpenAI/DeepSeek-compatible endpoints over the engine thread.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/cache/explain``, ``GET /health``, ``GET /metrics``,
``POST /tokenize``, ``POST /detokenize`` (``tokenize.py``), ``GET /kv/events`` and
``GET /kv/snapshot`` (``kv_events.py``) and Anthropic's ``POST /v1/messages`` (``anthropic.py``);
with ``--role prefill``, ``POST /internal/prefill`` and the forwarding of the generation
endpoints to decode workers (``pd.py``).

Answers are shaped by ``openai_replies.py`` (usage on every one, streamed or not) and
``anthropic.py``; ``delta_queue.py`` reads a request's deltas and notices a client's
disconnect. Headers ``x-deepinfer-prompt-encoding`` and ``x-deepinfer-history-rewritten`` say
how a chat prompt was encoded (see ``prompts.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from .anthropic import error_response, message_body, parse_messages_request, stream_events
from .api_error import APIError
from .async_engine import AsyncEngine
from .boundary import BearerAuth, CatchAll, read_json
from .config import ServerConfig, generation_defaults
from .delta_queue import await_disconnect, deltas_to_final, next_delta
from .kv_events import add_kv_event_routes, attach_event_log
from .metrics import render
from .openai_replies import OpenAIReplies
from .outputs import Admitted, Submission
from .pd import PrefillWorker, check_role
from .pd_decode import DecodeWorker
from .protocol import parse_request
from .request_fields import get_str
from .tokenize import detokenize, tokenize


class Server:
    """The endpoints' handlers, over one ``AsyncEngine``; ``build_app`` routes to them."""

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.engine = engine
        if self.config.chat_template is not None:  # before the tool parser is chosen from it
            engine.tokenizer.chat_template = self.config.chat_template
        self.defaults = generation_defaults(self.config.generation_config, engine.checkpoint_path)
        self.async_engine = AsyncEngine(engine, self.config)
        tiers = engine.kv.tiers
        self.kv_events = attach_event_log(engine.kv.tree, self.config.kv_events_buffer,
                                          None if tiers is None else tiers.backend.writing)
        self.model_name = self.config.served_model_name or engine.model_name
        self.model_names = {self.model_name, engine.model_name}
        if engine.config.model:
            self.model_names.add(str(engine.config.model))
        self.created = int(time.time())
        self.openai = OpenAIReplies(self.async_engine, self.model_name)
        check_role(self.config, engine.config)
        self.prefill_worker = PrefillWorker(self) if self.config.role == "prefill" else None
        self.decode_worker = DecodeWorker(self.async_engine, self.config)  # idle unless --role decode

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def _headers(self, rid: str, adm: Admitted) -> dict[str, str]:
        return {"x-request-id": rid,
                "x-deepinfer-prompt-encoding": adm.prompt.encoding,
                "x-deepinfer-history-rewritten": "true" if adm.prompt.history_rewritten
                else "false"}

    # ------------------------------------------------------------------ completions
    async def completion(self, request: Request, kind: str) -> Response:
        if self.prefill_worker is not None:  # prefill here, decode on a decode worker
            return await self.prefill_worker.public(request, kind)
        parsed = parse_request(await read_json(request, self.config.max_body_bytes), kind,
                               self.defaults)
        self.check_model(parsed.model)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        sub = Submission(rid, parsed, prefill=await self.decode_worker.receive(request))
        adm, q = await self.async_engine.submit(sub)
        headers = self._headers(rid, adm)
        watcher = asyncio.create_task(self.watch_disconnect(request, q, rid))
        if parsed.stream:
            return StreamingResponse(self.openai.stream(sub, q, watcher), headers=headers,
                                     media_type="text/event-stream")
        try:
            return await self.openai.collect(sub, q, headers)
        finally:
            watcher.cancel()

    def watch_disconnect(self, request: Request, q: asyncio.Queue, rid: str):
        """A coroutine that aborts ``rid`` when its client goes away."""
        return await_disconnect(request, q, lambda: self.async_engine.abort(rid))

    next_delta = staticmethod(next_delta)  # what a prefill worker reads its deltas with

    # ------------------------------------------------------------------ Anthropic
    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages`` (``anthropic.py``): the chat path, Anthropic-shaped."""
        try:
            if self.prefill_worker is not None:
                return await self.prefill_worker.public(request, "messages")
            parsed = parse_messages_request(
                await read_json(request, self.config.max_body_bytes), self.defaults)
            self.check_model(parsed.model)
            rid = f"msg_{uuid.uuid4().hex[:24]}"
            sub = Submission(rid, parsed, prefill=await self.decode_worker.receive(request))
            adm, q = await self.async_engine.submit(sub)
        except APIError as e:
            return error_response(e)
        headers = self._headers(rid, adm)
        watcher = asyncio.create_task(self.watch_disconnect(request, q, rid))
        deltas = deltas_to_final(q, watcher, lambda: self.async_engine.abort(rid))
        if parsed.stream:
            events = stream_events(rid, self.model_name, adm.num_prompt_tokens, deltas,
                                   self.async_engine.replies.stream(parsed, rid))
            return StreamingResponse(events, headers=headers, media_type="text/event-stream")
        text = []
        async for d in deltas:
            if d.error:
                return error_response(APIError(500, d.error, type="server_error"))
            text.append(d.text)
            if d.final:
                body = message_body(rid, self.model_name, "".join(text), d)
                return JSONResponse(body, headers=headers)
        return Response(status_code=499)  # the client left

    # ------------------------------------------------------------------ other endpoints
    async def explain(self, request: Request) -> Response:
        body = await read_json(request, self.config.max_body_bytes)
        kind = "chat" if "messages" in body else "completion"
        if kind == "completion" and "prompt" not in body:
            raise APIError(400, "give 'messages' (chat) or 'prompt' (completion)", param="prompt")
        parsed = parse_request(body, kind, self.defaults)
        self.check_model(parsed.model)
        out = await self.async_engine.call(lambda: self.async_engine.explain(parsed))
        return JSONResponse({**out, "model": self.model_name})

    async def on_engine(self, request: Request, fn) -> Response:
        """Answer ``fn(async_engine, body)``, run on the engine thread."""
        body = await read_json(request, self.config.max_body_bytes)
        self.check_model(get_str(body, "model"))
        return JSONResponse(await self.async_engine.call(lambda: fn(self.async_engine, body)))

    async def metrics(self) -> Response:
        stats, m = await self.async_engine.call(self.async_engine.snapshot)
        stats.update((self.prefill_worker or self.decode_worker).stats())
        return Response(render(stats, m, self.model_name),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "deepinfer", "max_model_len": self.engine.max_model_len}

    # ------------------------------------------------------------------ app
    def build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            self.async_engine.start(asyncio.get_running_loop())
            yield
            if self.prefill_worker is not None:
                await self.prefill_worker.close()
            await self.decode_worker.close()
            # uvicorn has already waited for open connections (up to its graceful timeout)
            await asyncio.to_thread(self.async_engine.shutdown, self.config.shutdown_timeout_s)

        app = FastAPI(title="DeepInfer", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.state.server = self

        @app.exception_handler(APIError)
        async def api_error(_: Request, e: APIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
            err = APIError(e.status_code, str(e.detail),
                           type="not_found_error" if e.status_code == 404 else
                           "invalid_request_error")
            return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

        @app.get("/health")
        async def health() -> Response:
            eng = self.async_engine
            if not eng.alive:
                return JSONResponse({"status": "engine stopped"}, status_code=503)
            if not eng.healthy:
                return JSONResponse({"status": "engine failing", "error": eng.last_error},
                                    status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models() -> dict:
            return self.models()

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> dict:
            self.check_model(model_id)
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.completion(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, "completion")

        @app.post("/v1/messages")
        async def messages(request: Request) -> Response:
            return await self.messages(request)

        @app.post("/tokenize")
        async def tokenize_route(request: Request) -> Response:
            return await self.on_engine(request, tokenize)

        @app.post("/detokenize")
        async def detokenize_route(request: Request) -> Response:
            return await self.on_engine(request, detokenize)

        if self.config.enable_cache_explain:
            @app.post("/v1/cache/explain")
            async def cache_explain(request: Request) -> Response:
                return await self.explain(request)

        if self.prefill_worker is not None:
            app.post("/internal/prefill")(self.prefill_worker.internal)
            app.post("/internal/release")(self.prefill_worker.release)

        @app.get("/metrics")
        async def metrics() -> Response:
            return await self.metrics()

        add_kv_event_routes(app, self.async_engine, self.kv_events)

        app.add_middleware(CatchAll)
        if self.config.api_key:
            app.add_middleware(BearerAuth, api_key=self.config.api_key)
        return app


def create_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    return Server(engine, config).build_app()
