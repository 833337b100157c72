"""OpenAI-shaped answers of ``/v1/chat/completions`` and ``/v1/completions``: a request's
deltas gathered into one body, or streamed as server-sent events.

Every answer carries usage, streamed or not (``outputs.Usage.to_dict``). A stream carries it on
its last choice chunk (the one with ``finish_reason``, as DeepSeek does); with
``stream_options.include_usage`` one more chunk follows with ``choices: []`` and the usage (as
OpenAI does). A reader that stops early (client gone, an error) aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from .api_error import APIError
from .async_engine import AsyncEngine
from .delta_queue import next_delta
from .outputs import Submission
from .protocol import ParsedRequest
from .tools import StreamPiece, ToolOutput


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


class OpenAIReplies:
    """A chat or completion request's deltas, answered whole (``collect``) or streamed."""

    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    async def collect(self, sub: Submission, q: asyncio.Queue, headers: dict) -> Response:
        p, rid = sub.parsed, sub.request_id
        n = p.params.n
        text: list[list[str]] = [[] for _ in range(n)]
        entries: list[list[dict] | None] = [[] if p.want_logprobs else None for _ in range(n)]
        finish: list[str | None] = [None] * n
        usage = tool_output = None
        done = False
        try:
            while usage is None:  # the last delta of the request carries its usage
                d = await next_delta(q, merge=n == 1)
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

    async def stream(self, sub: Submission, q: asyncio.Queue,
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
                d = await next_delta(q, merge=n == 1)
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
