"""FastAPI app: OpenAI/DeepSeek-compatible endpoints over the engine thread.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/cache/explain``, ``GET /health``, ``GET /metrics``,
``POST /tokenize``, ``POST /detokenize`` (``tokenize.py``), ``GET /kv/events`` and
``GET /kv/snapshot`` (``kv_events.py``) and Anthropic's ``POST /v1/messages`` (``anthropic.py``);
with ``--role prefill``, ``POST /internal/prefill`` and the forwarding of the generation
endpoints to decode workers (``pd.py``).

Every response carries usage, streamed or not: ``prompt_tokens``, ``completion_tokens``,
``total_tokens``, ``prompt_cache_hit_tokens`` + ``prompt_cache_miss_tokens`` (DeepSeek; they
sum to ``prompt_tokens``), ``prompt_tokens_details.cached_tokens`` (OpenAI) and
``prompt_tokens_details.cached_tokens_by_tier``. A stream carries usage on its last choice
chunk (the one with ``finish_reason``, as DeepSeek does); with
``stream_options.include_usage`` one more chunk follows with ``choices: []`` and the usage
(as OpenAI does). Headers ``x-deepinfer-prompt-encoding`` and
``x-deepinfer-history-rewritten`` say how a chat prompt was encoded (see ``prompts.py``).

Client disconnects are noticed by a task that waits for the ASGI ``http.disconnect``
message; the request is then aborted on the engine and its pages go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import LLMEngine
from .anthropic import error_response, message_body, parse_messages_request, stream_events
from .api_error import APIError
from .async_engine import AsyncEngine
from .boundary import BearerAuth, CatchAll, read_json
from .config import ServerConfig, generation_defaults
from .kv_events import add_kv_event_routes, attach_event_log
from .metrics import render
from .outputs import Admitted, Delta, Submission, merge_deltas
from .pd import PrefillWorker, check_role
from .pd_decode import DecodeWorker
from .protocol import ParsedRequest, parse_request
from .request_fields import get_str
from .tokenize import detokenize, tokenize
from .tools import StreamPiece, ToolOutput

_DISCONNECTED = object()


# ---------------------------------------------------------------------- formatting
def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None

    def one(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**one(e["token"], e["logprob"]),
                         "top_logprobs": [one(t, lp) for _, t, lp in e["top"]]}
                        for e in entries]}


def _completion_logprobs(entries: list[dict] | None, offset: int) -> tuple[dict | None, int]:
    if entries is None:
        return None, offset
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for _, t, lp in e["top"]} for e in entries],
            "text_offset": offsets}, offset


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _watch_disconnect(request: Request, q: asyncio.Queue, on_disconnect) -> None:
    """When the client goes away (after the body was read): ``on_disconnect()`` and put
    ``_DISCONNECTED`` in ``q`` for whoever waits on it."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                on_disconnect()
                q.put_nowait(_DISCONNECTED)
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - nothing more to learn from this connection
        return


# ---------------------------------------------------------------------- app
class Server:
    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.engine = engine
        if self.config.chat_template is not None:  # before the tool parser is chosen from it
            engine.tokenizer.chat_template = self.config.chat_template
        self.defaults = generation_defaults(self.config.generation_config, engine.checkpoint_path)
        self.async_engine = AsyncEngine(engine, self.config)
        self.kv_events = attach_event_log(engine.kv.tree, self.config.kv_events_buffer)
        self.model_name = self.config.served_model_name or engine.model_name
        self.model_names = {self.model_name, engine.model_name}
        if engine.config.model:
            self.model_names.add(str(engine.config.model))
        self.created = int(time.time())
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
            return StreamingResponse(self._stream(sub, q, watcher), headers=headers,
                                     media_type="text/event-stream")
        try:
            return await self._collect(sub, q, headers)
        finally:
            watcher.cancel()

    def watch_disconnect(self, request: Request, q: asyncio.Queue, rid: str):
        """A coroutine that aborts ``rid`` when its client goes away."""
        return _watch_disconnect(request, q, lambda: self.async_engine.abort(rid))

    @staticmethod
    async def next_delta(q: asyncio.Queue, merge: bool = True) -> Delta | None:
        """The next delta, merged with any others already queued (one choice only: deltas of
        several interleave); None once the client left."""
        d = await q.get()
        while merge and d is not _DISCONNECTED and not d.final and not q.empty():
            nxt = q.get_nowait()
            if nxt is _DISCONNECTED:
                q.put_nowait(nxt)  # seen on the next call
                break
            d = merge_deltas(d, nxt)
        return None if d is _DISCONNECTED else d

    async def _collect(self, sub: Submission, q: asyncio.Queue, headers: dict) -> Response:
        p, rid = sub.parsed, sub.request_id
        n = p.params.n
        text: list[list[str]] = [[] for _ in range(n)]
        entries: list[list[dict] | None] = [[] if p.want_logprobs else None for _ in range(n)]
        finish: list[str | None] = [None] * n
        usage = tool_output = None
        done = False
        try:
            while usage is None:  # the last delta of the request carries its usage
                d = await self.next_delta(q, merge=n == 1)
                if d is None:  # client gone: nobody reads the answer
                    return Response(status_code=499)
                if d.error:
                    done = True
                    raise APIError(500, d.error, type="server_error")
                text[d.index].append(d.text)
                if entries[d.index] is not None and d.logprobs:
                    entries[d.index].extend(d.logprobs)
                finish[d.index] = d.finish_reason or finish[d.index]
                tool_output = d.tool_output or tool_output
                usage = d.usage
            done = True
        finally:
            if not done:
                self.async_engine.abort(rid)
        choices = [self._choice(p, i, "".join(text[i]), entries[i], finish[i],
                                tool_output if i == 0 else None) for i in range(n)]
        body = self._response(p, rid, choices, usage.to_dict())
        return JSONResponse(body, headers=headers)

    @staticmethod
    def _choice(p: ParsedRequest, index: int, text: str, entries, finish: str | None,
                tools: ToolOutput | None = None) -> dict:
        if p.kind == "chat":
            message = {"role": "assistant", "content": text}
            if tools is not None:
                message = {"role": "assistant", "content": tools.content or None,
                           "tool_calls": [c.to_openai() for c in tools.calls] or None}
                if tools.reasoning is not None:
                    message["reasoning_content"] = tools.reasoning
            return {"index": index, "message": message,
                    "logprobs": _chat_logprobs(entries), "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": _completion_logprobs(entries, 0)[0],
                "finish_reason": finish}

    def _response(self, p: ParsedRequest, rid: str, choices: list[dict], usage: dict) -> dict:
        obj = "chat.completion" if p.kind == "chat" else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage}

    async def _stream(self, sub: Submission, q: asyncio.Queue,
                      watcher: asyncio.Task) -> AsyncIterator[str]:
        p, rid = sub.parsed, sub.request_id
        chat = p.kind == "chat"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}
        n = p.params.n
        offsets = [0] * n  # per choice: completions' logprobs text_offset
        done = False
        tool_stream = self.async_engine.replies.stream(p, rid)

        def chunk(text: str, entries, finish: str | None, index: int = 0,
                  role: bool = False, piece: StreamPiece | None = None) -> dict:
            if chat:
                delta = {"role": "assistant", "content": text} if role else (
                    {"content": text} if text or not finish else {})
                if piece is not None and piece.reasoning:
                    delta["reasoning_content"] = piece.reasoning
                if piece is not None and piece.calls:
                    delta["tool_calls"] = [c.to_openai() for c in piece.calls]
                choice = {"index": index, "delta": delta, "logprobs": _chat_logprobs(entries),
                          "finish_reason": finish}
            else:
                lp, offsets[index] = _completion_logprobs(entries, offsets[index])
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            return {**head, "choices": [choice]}

        try:
            if chat:
                for i in range(n):
                    yield _sse(chunk("", None, None, i, role=True))
            while True:
                d = await self.next_delta(q, merge=n == 1)
                if d is None:
                    return
                if d.error:
                    done = True
                    err = APIError(500, d.error, type="server_error")
                    yield _sse(err.body())
                    yield "data: [DONE]\n\n"
                    return
                entries = d.logprobs if p.want_logprobs else None
                text, piece = d.text, None
                if tool_stream is not None:  # (tools come with n == 1)
                    piece = tool_stream.finish(d.tool_output, d.token_ids) if d.final else \
                        tool_stream.push(d.text, d.token_ids)
                    text = piece.content
                if d.usage is None:  # not the request's last delta
                    if text or (piece and (piece.calls or piece.reasoning)) or entries \
                            or d.finish_reason:
                        yield _sse(chunk(text, entries, d.finish_reason, d.index, piece=piece))
                    continue
                done = True
                usage = d.usage.to_dict()
                yield _sse({**chunk(text, entries, d.finish_reason, d.index, piece=piece),
                            "usage": usage})
                if p.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"
                return
        finally:
            watcher.cancel()
            if not done:
                self.async_engine.abort(rid)

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
        deltas = self._deltas(sub, q, asyncio.create_task(self.watch_disconnect(request, q, rid)))
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

    async def _deltas(self, sub: Submission, q: asyncio.Queue,
                      watcher: asyncio.Task) -> AsyncIterator[Delta]:
        """A request's deltas up to its final one; aborts it if the reader stops early."""
        done = False
        try:
            while True:
                d = await self.next_delta(q)
                if d is None:
                    return
                done = d.final
                yield d
                if done:
                    return
        finally:
            watcher.cancel()
            if not done:
                self.async_engine.abort(sub.request_id)

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
