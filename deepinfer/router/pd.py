"""Prefill/decode routing: a prefill worker computes the prompt, a decode worker generates.

Per request: a prefill worker chosen by the kv cost (its prefix index, its load) gets
``POST /internal/prefill`` with ``{"endpoint": "chat"|"completion"|"messages", "request":
BODY}``; it computes the prompt, makes its full pages durable in the shared store and answers
with its counts. A decode worker chosen by load alone (its hits come from the store, whoever computed
them) then gets the original request, with those counts in the ``x-deepinfer-prefill`` header
(the decode side reports them in its usage) and, on the direct route (``--pd-transfer direct``),
the descriptor of the pages it pulls from the prefill worker. See ``server/pd.py`` for the
workers' side.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from fastapi.responses import Response

from ..server.pd_decode import TRANSFER_HEADER
from .proxy import passed_headers, unless_disconnected, whole

PREFILL_HEADER = "x-deepinfer-prefill"


async def prefill(client: httpx.AsyncClient, request: Request, url: str, kind: str,
                  body: dict, headers: dict[str, str]) -> httpx.Response | None:
    """The prefill worker's answer to ``POST /internal/prefill``; None if the client left.
    Connect errors propagate (the caller tries the next prefill worker)."""
    work = asyncio.ensure_future(client.post(
        url + "/internal/prefill", headers=headers,
        content=json.dumps({"endpoint": kind, "request": body}).encode()))
    return await unless_disconnected(request, work)


def failed(resp: httpx.Response, url: str) -> Response:
    """A prefill worker's answer that is not a 200, passed back to the client."""
    return whole(resp, resp.content, passed_headers(resp, {"x-deepinfer-worker": url}))


def decode_headers(counts: dict, headers: dict[str, str], prefill_url: str) -> dict[str, str]:
    """Headers of the request to the decode worker: the prefill's numeric counts, and the
    descriptor of its exported pages when it kept them for a direct pull."""
    numbers = {k: v for k, v in counts.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out = {**headers, PREFILL_HEADER: json.dumps(numbers), "x-deepinfer-prefill-worker": prefill_url}
    if isinstance(counts.get("transfer"), dict):
        out[TRANSFER_HEADER] = json.dumps(counts["transfer"])
    return out
