"""Forwarding one request to a worker and its answer back, bytes unchanged.

A streamed answer is relayed chunk by chunk as it arrives; the usage in it (the last choice
chunk's, as the worker sends it; Anthropic's ``message_delta``) is read on the way for the
router's metrics, and so is the moment its first token arrives (the worker's prefill is over:
the router's load estimate moves it from prefilling to decoding). A client that
goes away closes the upstream connection, and the worker aborts the request (its own
disconnect handling), streamed or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

# Response headers passed back (hop-by-hop ones and content-length are the router's own).
_PASSED = ("content-type", "x-request-id", "x-deepinfer-prompt-encoding",
           "x-deepinfer-history-rewritten", "retry-after")


def cached_tokens(usage: dict | None) -> int | None:
    """OpenAI's ``prompt_tokens_details.cached_tokens`` or Anthropic's
    ``cache_read_input_tokens``."""
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("cache_read_input_tokens"), int):
        return usage["cache_read_input_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


class StreamSniffer:
    """Reads an SSE stream as its bytes go by (without altering them): the ``usage`` in it,
    and ``on_first_token()`` at its ``first_token_event``-th data event (the events a worker
    sends before the first token, as a chat stream's role chunk, come before it)."""

    def __init__(self, first_token_event: int, on_first_token: Callable[[], None]) -> None:
        self._tail = b""
        self._events_left = first_token_event
        self._on_first_token = on_first_token
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if self._events_left and line.startswith(b"data: "):
                self._events_left -= 1
                if not self._events_left:
                    self._on_first_token()
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    found = cached_tokens(json.loads(line[6:]).get("usage"))
                except ValueError:
                    continue
                if found is not None:
                    self.cached_tokens = found


def passed_headers(resp: httpx.Response, extra: dict[str, str]) -> dict[str, str]:
    return {**{k: resp.headers[k] for k in _PASSED if k in resp.headers}, **extra}


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: asyncio.Future):
    """``await work``, or cancel it and return None if the client leaves first."""
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        return None
    finally:
        watcher.cancel()


async def relay(resp: httpx.Response, sniffer: StreamSniffer,
                on_end: Callable[[], None]) -> AsyncIterator[bytes]:
    """The upstream stream's bytes; closing it (the client left) closes the upstream."""
    try:
        async for chunk in resp.aiter_raw():
            sniffer.feed(chunk)
            yield chunk
    finally:
        await resp.aclose()
        on_end()


def streamed(resp: httpx.Response, headers: dict[str, str], sniffer: StreamSniffer,
             on_end: Callable[[], None]) -> StreamingResponse:
    return StreamingResponse(relay(resp, sniffer, on_end), status_code=resp.status_code,
                             headers=headers, media_type=resp.headers.get("content-type"))


def whole(resp: httpx.Response, body: bytes, headers: dict[str, str]) -> Response:
    return Response(body, status_code=resp.status_code, headers=headers,
                    media_type=resp.headers.get("content-type"))
