"""Client-side helpers of the router tests: the router's state, the index settling, metrics."""

from __future__ import annotations

import re
import time

import httpx

HTTP_TIMEOUT = 60.0  # a loaded machine answers slowly: the polls below wait, they do not fail


def state(router_url: str) -> dict[str, dict]:
    workers = httpx.get(router_url + "/router/workers", timeout=HTTP_TIMEOUT).json()["workers"]
    return {w["url"]: w for w in workers}


def settle(router_url: str, worker_urls: list[str], timeout: float = 120.0,
           headers: dict[str, str] | None = None) -> None:
    """Wait until the router's index has applied every KV event the workers have emitted
    (``headers``: for workers that require an API key)."""
    t0 = time.monotonic()
    while True:
        st = state(router_url)
        behind = [u for u in worker_urls
                  if not st[u]["synced"] or
                  st[u]["seq"] < httpx.get(u + "/kv/snapshot", headers=headers,
                                           timeout=HTTP_TIMEOUT).json()["seq"]]
        if not behind:
            return
        assert time.monotonic() - t0 < timeout, f"index of {behind} did not catch up: {st}"
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (any labels) on ``url``'s /metrics."""
    text = httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT).text
    pattern = rf"^\S*{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))
