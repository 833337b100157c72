"""PD routing: the router prefills each request on a ``--role prefill`` worker (kv cost) and
sends it to a ``--role decode`` worker (load), the KV passing through a real Redis store or,
on the direct route, pulled from the prefill worker over the transfer engine."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
from router_procs import PAGE, RouterThread, free_port, spawn_worker, wait_healthy
from router_helpers import settle, state

pytest.importorskip("deepinfer.server.pd", reason="needs the workers' --role (PD) support")


@pytest.fixture(scope="module", params=["store", "direct"])
def pd_router(request, tiny_llama, tmp_path_factory):
    redis = shutil.which("redis-server")
    if redis is None:
        pytest.skip("redis-server not installed (scripts/setup.sh installs it)")
    port = free_port()
    store = subprocess.Popen([redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    kv = ["--kv-store", f"redis://127.0.0.1:{port}", "--pd-transfer", request.param]
    prefill = spawn_worker(tiny_llama, "--role", "prefill", *kv)
    decode = spawn_worker(tiny_llama, "--role", "decode", *kv)
    router = None
    try:
        for w in (prefill, decode):
            wait_healthy(w.url, w.proc, "deepinfer serve --role")
        router = RouterThread(tiny_llama, [], prefill_workers=[prefill.url],
                              decode_workers=[decode.url])
        yield router.url, prefill.url, decode.url, request.param
    finally:
        if router is not None:
            router.stop()
        for w in (prefill, decode):
            w.stop()
        store.terminate()
        store.wait(30)


def test_prefill_then_decode_on_two_workers(pd_router):
    router, prefill, decode, route = pd_router
    messages = [{"role": "system", "content": "You explain caches of key value pairs."},
                {"role": "user", "content": "What is a prefix cache, in two lines?"}]
    for turn in range(2):
        r = httpx.post(router + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-deepinfer-worker"] == decode
        usage = r.json()["usage"]
        n = usage["prompt_tokens"]
        pre = usage["prefill_worker"]  # the prefill's counts, as the decode worker got them
        assert pre["pages_failed"] == 0
        if turn == 0:  # the decode worker computed only what the prefill could not publish
            assert pre["prompt_tokens"] == n
            assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE
            from_worker = usage["prompt_tokens_details"]["cached_tokens_from_prefill_worker"]
            assert from_worker == (usage["prompt_tokens_details"]["cached_tokens"] if route == "direct" else 0)
        else:  # the prefill worker hit the first turn's pages (the router predicted them: below)
            assert pre["cached_tokens"] > 0
        messages += [r.json()["choices"][0]["message"],
                     {"role": "user", "content": "And a third line?"}]
        settle(router, [prefill, decode])
    st = state(router)
    assert st[prefill]["routed"] == 2 and st[decode]["routed"] == 2
    assert 0 < st[prefill]["predicted_hit_tokens"] <= st[prefill]["reported_hit_tokens"]
