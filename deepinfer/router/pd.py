"""Prefill/decode routing: a prefill worker computes the prompt, a decode worker generates.

Per request: a prefill worker chosen by the kv cost (its prefix index, its load) gets
``POST /internal/prefill`` with ``{"endpoint": "chat"|"completion", "request": BODY}``; it
computes the prompt, makes its full pages durable in the shared store and answers with its
counts. A decode worker chosen by load alone (its hits come from the store, whoever computed
them) then gets the original request, with those counts in the ``x-deepinfer-prefill`` header
(the decode side reports them in its usage). See ``server/pd.py`` for the workers' side.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from fastapi.responses import Response

from .policy import Choice
from .prompts import RoutedPrompt
from .proxy import passed_headers, unless_disconnected, whole

PREFILL_HEADER = "x-deepinfer-prefill"


async def prefill(client: httpx.AsyncClient, request: Request, choice: Choice, kind: str,
                  body: dict, prompt: RoutedPrompt, headers: dict[str, str]
                  ) -> dict | Response | None:
    """The prefill worker's counts; its answer itself if it is not a 200; None if the client
    left. Connect errors propagate (the caller tries the next prefill worker)."""
    w = choice.worker
    pages = prompt.pages(w.page_size)
    w.begin(pages)
    try:
        work = asyncio.ensure_future(client.post(
            w.url + "/internal/prefill", headers=headers,
            content=json.dumps({"endpoint": kind, "request": body}).encode()))
        resp = await unless_disconnected(request, work)
    finally:
        w.end(pages)
    if resp is None:
        return None
    w.routed += 1
    w.predicted_hit_tokens += choice.predicted_hit_tokens
    if resp.status_code != 200:
        return whole(resp, resp.content, passed_headers(resp, {"x-deepinfer-worker": w.url}))
    counts = resp.json()
    w.reported_hit_tokens += int(counts.get("cached_tokens") or 0)
    return counts


def decode_headers(counts: dict, headers: dict[str, str], prefill_url: str) -> dict[str, str]:
    """Headers of the request to the decode worker: the prefill's numeric counts."""
    numbers = {k: v for k, v in counts.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**headers, PREFILL_HEADER: json.dumps(numbers),
            "x-deepinfer-prefill-worker": prefill_url}
