"""A worker started with ``--api-key``: the router's ``--worker-api-key`` opens its KV events
and snapshot to the router, and clients' own keys pass through on their requests."""

from __future__ import annotations

import httpx
import pytest
from router_helpers import settle, state
from router_procs import RouterThread, start_worker

KEY = "router-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_worker(tiny_llama):
    w = start_worker(tiny_llama, "--api-key", KEY)
    yield w
    w.stop()


def test_router_reads_the_events_of_a_worker_that_requires_a_key(tiny_llama, keyed_worker):
    url = keyed_worker.url
    assert httpx.get(url + "/kv/snapshot").status_code == 401
    keyed = RouterThread(tiny_llama, [url], worker_api_key=KEY)
    try:
        settle(keyed.url, [url], headers=AUTH)
        prompt = {"prompt": "a keyed worker holds these pages " * 4, "max_tokens": 2,
                  "temperature": 0}
        assert httpx.post(keyed.url + "/v1/completions", json=prompt).status_code == 401
        r = httpx.post(keyed.url + "/v1/completions", json=prompt, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        settle(keyed.url, [url], headers=AUTH)
        st = state(keyed.url)[url]
        assert st["synced"] and st["index_pages"] > 0 and st["event_resets"] == 0
        again = httpx.post(keyed.url + "/v1/completions", json=prompt, headers=AUTH,
                           timeout=120).json()
        assert state(keyed.url)[url]["predicted_hit_tokens"] == \
            again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        keyed.stop()


def test_config_rejects_negative_weights():
    from deepinfer.router.config import RouterConfig

    with pytest.raises(ValueError, match="decode_weight"):
        RouterConfig(workers=["http://127.0.0.1:1"], decode_weight=-1)
