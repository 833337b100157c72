"""The server's engine thread promotes recent conversations' L3 pages to L2 while idle
(``--kv-idle-promote-mb``): the next turn over HTTP loads from L2."""

import time

import httpx
from server_helpers import start_server, wait_idle

from deepinfer.kv.radix import DEVICE, HOST

PAGE_BYTES = 4 * 2 * 2 * 2 * 16 * 4  # tiny Llama page: 4 tokens x 2 layers x K,V x 2 heads x 16, fp32


def complete(srv, prompt):
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"model": srv.server_obj.model_name, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def test_idle_server_promotes_the_last_conversation_to_l2(tiny_llama, tmp_path):
    first = list(range(10, 50))  # 10 pages
    srv = start_server(tiny_llama, {"disk_cache_dir": str(tmp_path), "kv_idle_promote_mb": 1.0,
                                    "host_cache_gb": 64 * PAGE_BYTES / 2**30})
    eng = srv.async_engine.engine
    try:
        complete(srv, first)
        wait_idle(srv)

        def to_l3_only():  # what later traffic does to an idle conversation, then a step
            eng.kv.evict()
            eng.tiers.flush()
            eng.kv.evict(HOST)
            eng.kv.poll()
            return eng.kv.tree.pages_in_tier[DEVICE], eng.kv.tree.pages_in_tier[HOST]

        assert srv.async_engine.call_sync(to_l3_only) == (0, 0)
        t0 = time.monotonic()  # the engine thread, idle, promotes on its own
        while srv.async_engine.call_sync(lambda: eng.stats()["cache_idle_promoted_pages_total"]) < 10:
            assert time.monotonic() - t0 < 120
            time.sleep(0.05)
        assert complete(srv, first + list(range(60, 72))) == {"host": 40}
    finally:
        srv.stop()
