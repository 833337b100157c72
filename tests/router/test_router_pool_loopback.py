"""Two real workers sharing a real Redis KV pool behind the router: their snapshots name the same
pool, the pages one worker wrote there reach the router as that worker's L3 events, the router
predicts them as hits on the other worker, and that worker does load them from the pool; two
requests sharing a new prefix at once compute it once (one waits for it in the pool)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from router_helpers import HTTP_TIMEOUT, settle, state
from router_procs import PAGE, RouterThread, spawn_worker, wait_healthy
from store_services import redis

from deepinfer.router.prompts import RoutedPrompt
from deepinfer.server.kv_events import pool_id
from deepinfer.server.protocol import parse_request

SYSTEM = list(range(10, 50))  # 10 pages shared by both requests


@pytest.fixture(scope="module")
def pooled(tiny_llama, tmp_path_factory):
    store = redis(tmp_path_factory.mktemp("redis-logs")).start()
    kv = ["--kv-store", store.url, "--kv-store-option", "timeout_s=10"]
    procs = [spawn_worker(tiny_llama, *kv) for _ in range(2)]
    router = None
    try:
        for p in procs:
            wait_healthy(p.url, p.proc, "deepinfer serve --kv-store")
        router = RouterThread(tiny_llama, [p.url for p in procs])
        yield router, [p.url for p in procs], store
    finally:
        if router is not None:
            router.stop()
        for p in procs:
            p.stop()
        store.kill()


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=HTTP_TIMEOUT,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json() | {"worker": r.headers.get("x-deepinfer-worker")}


def _wait_written(store_url: str, pages: int, timeout: float = 120.0) -> None:
    """Until the pool holds ``pages`` keys (a worker records L3 before its write lands)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(store_url)
    t0 = time.monotonic()
    while client.dbsize() < pages:
        assert time.monotonic() - t0 < timeout, f"{client.dbsize()} of {pages} pages written"
        time.sleep(0.05)


def test_pages_one_worker_wrote_to_the_pool_are_predicted_and_loaded_on_the_other(pooled):
    router, urls, store = pooled
    settle(router.url, urls)
    ws = router.router.pool.by_url
    assert ws[urls[0]].pool_id == ws[urls[1]].pool_id == pool_id(store.url) is not None
    served = _complete(router.url, SYSTEM + list(range(100, 109)))["worker"]
    other = next(u for u in urls if u != served)
    settle(router.url, urls)
    _wait_written(store.url, len(httpx.get(served + "/kv/snapshot").json()["pages"]["disk"]))
    second = SYSTEM + list(range(200, 209))
    prompt = RoutedPrompt(parse_request({"prompt": second, "max_tokens": 2}, "completion"),
                          second)
    hit = router.router.policy.overlap(ws[other], prompt, [served])
    assert (hit.pages, hit.pooled) == (0, len(SYSTEM) // PAGE)
    usage = _complete(other, second)["usage"]  # straight to the other worker
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == len(SYSTEM)
    assert details["cached_tokens_by_tier"] == {"disk": len(SYSTEM)}


def test_two_requests_sharing_a_new_prefix_compute_it_once(pooled):
    """Sent at once through the router: on idle workers the kv cost puts them on different
    workers, and the second waits at the router until the first's worker wrote the shared pages
    to the pool, then loads them there (a first that ends before the second is routed leaves
    them in the pool as well). Either way the prefix is computed once, and no wait ran out."""
    router, urls, _ = pooled
    settle(router.url, urls)
    system = list(range(250, 290))  # 10 pages no earlier request had
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda u: _complete(router.url, system + list(range(u, u + 9))),
                           (290, 300)))
    hits = sorted(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    assert hits == [0, len(system)]
    second = max(outs, key=lambda o: o["usage"]["prompt_tokens_details"]["cached_tokens"])
    tiers = second["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    if outs[0]["worker"] != outs[1]["worker"]:
        assert tiers == {"disk": len(system)}  # loaded from the pool, not computed again
    st = state(router.url)
    assert sum(w["pool_wait_timeouts"] for w in st.values()) == 0
