"""What every request crosses before a handler reads it: the API key, the body's type and
size, and a last-resort answer for an unexpected error that keeps the connection usable."""

from __future__ import annotations

import hmac
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from .api_error import APIError
from .json_body import parse_json_body

log = logging.getLogger("deepinfer.server")


class CatchAll:
    """ASGI middleware: an unexpected exception becomes a 500 answer, and the connection stays
    usable (Starlette's own last-resort handler re-raises, and the server then drops the
    keep-alive connection with the next request on it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - answered here, logged once
            log.exception("unhandled error")
            if started:  # a stream already begun: all we can do is end it
                raise
            err = APIError(500, f"internal error: {type(e).__name__}", type="server_error")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's JSON object: 415 unless the body is JSON, 413 past ``max_bytes``."""
    ctype = request.headers.get("content-type", "application/json")
    mime = ctype.split(";", 1)[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (content-type application/json), "
                            f"got content-type {ctype[:80]!r}", code="unsupported_media_type")
    too_big = APIError(413, f"the request body is larger than {max_bytes} bytes",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > max_bytes:
            raise too_big
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


class BearerAuth:
    """ASGI middleware: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``)
    on every path but /health."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        auth = x_api_key = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                auth = v
            elif k == b"x-api-key":
                x_api_key = v
        scheme, _, token = auth.partition(b" ")
        if (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)) or \
                (x_api_key and hmac.compare_digest(x_api_key.strip(), self.key)):
            return await self.app(scope, receive, send)
        err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
        resp = JSONResponse(err.body(), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)

