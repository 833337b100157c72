"""Cache salts, and the cache-miss explainer (over HTTP and on a bare cache manager)."""

import random

import httpx
import pytest
from server_helpers import PAGE, make_engine, no_lower_tiers, start_server

from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.explain import explain_prefix
from deepinfer.kv.hashing import chain_hashes
from deepinfer.kv.pool import PageAllocator
from deepinfer.kv.radix import DEVICE, HOST
from deepinfer.sampling_params import SamplingParams


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def complete(url, prompt, salt=None, **kw):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def explain(url, body):
    r = httpx.post(url + "/v1/cache/explain", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_salted_requests_never_hit_another_salts_entries(server):
    p = tokens(40, seed=1)
    assert complete(server.url, p, salt="tenant-a")["prompt_cache_hit_tokens"] == 0
    assert complete(server.url, p, salt="tenant-a")["prompt_cache_hit_tokens"] == 36
    assert complete(server.url, p, salt="tenant-b")["prompt_cache_hit_tokens"] == 0
    assert complete(server.url, p)["prompt_cache_hit_tokens"] == 0  # unsalted
    # The explainer describes the asking tenant's cache only: no hint, no other tenant's tokens.
    ex = explain(server.url, {"prompt": p, "cache_salt": "tenant-c"})
    assert ex["prompt_cache_hit_tokens"] == 0 and ex["stop"]["reason"] == "not_cached"
    assert "cached_after" not in ex["stop"]["context"] and "other_salt_tokens" not in ex["stop"]


def test_cross_tenant_explainer_hints_only_when_the_operator_allows(tiny_llama):
    srv = start_server(tiny_llama, explain_cross_tenant=True)
    try:
        p = tokens(40, seed=11)
        complete(srv.url, p, salt="tenant-a")
        ex = explain(srv.url, {"prompt": p, "cache_salt": "tenant-c"})
        assert ex["prompt_cache_hit_tokens"] == 0 and ex["stop"]["reason"] == "salt"
        assert ex["stop"]["other_salt_tokens"] == 40
        assert "tenant" not in str(ex["stop"])  # which salt holds it is not revealed
    finally:
        srv.stop()


def test_explainer_on_a_hand_made_divergence(server):
    a = tokens(40, seed=2)
    complete(server.url, a)
    b = list(a)
    b[22] = 7 if a[22] != 7 else 8  # differs in the sixth page (tokens 20..23)
    ex = explain(server.url, {"prompt": b})
    assert ex["prompt_tokens"] == 40
    assert ex["prompt_cache_hit_tokens"] == 20 and ex["prompt_cache_miss_tokens"] == 20
    assert ex["spans"] == [{"start": 0, "end": 20, "tokens": 20, "tier": "device"}]
    assert ex["cached_tokens_by_tier"] == {"device": 20}
    stop = ex["stop"]
    assert stop["reason"] == "diverged" and stop["diverge_at"] == 22
    assert stop["request_token"]["id"] == b[22] and stop["cached_token"]["id"] == a[22]
    ctx = stop["context"]
    tok_dec = server.async_engine.tokenizer.decode
    assert ctx["before"] == tok_dec(a[6:22])
    assert ctx["request_after"] == tok_dec(b[22:38])
    assert ctx["cached_after"] == tok_dec(a[22:38])
    # explaining changed nothing, and the prediction is what the request then gets
    assert explain(server.url, {"prompt": b}) == ex
    assert complete(server.url, b)["prompt_cache_hit_tokens"] == 20
    # the same prompt again: every page hits, but the last one is recomputed
    again = explain(server.url, {"prompt": a})
    assert again["prompt_cache_hit_tokens"] == 36 and again["stop"]["reason"] == "last_token"
    longer = explain(server.url, {"prompt": a + [5, 6]})
    assert longer["prompt_cache_hit_tokens"] == 40 and longer["stop"]["reason"] == "partial_page"
    fresh = explain(server.url, {"prompt": tokens(12, seed=3)})
    assert fresh["prompt_cache_hit_tokens"] == 0 and fresh["stop"]["reason"] == "not_cached"


def test_explainer_accepts_chat_bodies(server, client, model_name):
    msgs = [{"role": "user", "content": "explain my cache misses please"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    nxt = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "and again"}]
    ex = explain(server.url, {"model": model_name, "messages": nxt})
    assert ex["prompt_encoding"]["encoding"] == "extended"
    assert ex["prompt_cache_hit_tokens"] >= r.usage.prompt_tokens + 3 - PAGE
    got = client.chat.completions.create(model=model_name, messages=nxt, max_tokens=1)
    assert got.usage.prompt_tokens_details.cached_tokens == ex["prompt_cache_hit_tokens"]
    assert httpx.post(server.url + "/v1/cache/explain", json={"model": "x", "prompt": "a"}
                      ).status_code == 404


def test_explainer_reports_evicted_pages(tiny_llama):
    # 139 usable pages, and no lower tier to demote evicted pages to
    srv = start_server(tiny_llama, engine_kw=dict(num_pages=140, **no_lower_tiers()))
    try:
        a = tokens(40, seed=8)
        complete(srv.url, a)
        assert explain(srv.url, {"prompt": a})["prompt_cache_hit_tokens"] == 36
        for seed in range(9, 13):  # 4 x 50 pages: pushes ``a`` out of the pool
            complete(srv.url, tokens(200, seed=seed))
        ex = explain(srv.url, {"prompt": a})
        assert ex["stop"]["reason"] == "evicted" and ex["prompt_cache_hit_tokens"] == 0
        assert ex["evicted_pages_total"] > 0
        assert complete(srv.url, a)["prompt_cache_hit_tokens"] == 0
    finally:
        srv.stop()


# ---------------------------------------------------------------------- on the cache manager
PS = 4


@pytest.fixture()
def kv():
    return KVCacheManager(PageAllocator(64), PS, "model-id", True, max_node_pages=64)


def insert(kv, toks, tier=DEVICE, salt=None):
    h = chain_hashes(toks, PS, kv.root(salt))
    values = kv.allocator.alloc(len(h)) if tier == DEVICE else list(range(len(h)))
    kv.tree.insert(h, toks[: len(h) * PS], tier, values)
    return h


def test_explain_does_not_split_or_touch(kv):
    a = tokens(24, seed=4)
    insert(kv, a)
    nodes, stamps = kv.tree.num_nodes(), [n.last_access for n in kv.tree.root.children.values()]
    b = a[:10] + [1] + a[11:]
    ex = explain_prefix(kv, b)
    assert ex.reason == "diverged" and ex.diverge_at == 10 and ex.hit_tokens == 8
    assert ex.cached_tokens[:4] == a[8:12]
    assert kv.tree.num_nodes() == nodes  # RadixTree.match would have split the node here
    assert [n.last_access for n in kv.tree.root.children.values()] == stamps


def test_explain_reports_tiers_of_spans(kv):
    a = tokens(32, seed=5)
    insert(kv, a[:8])  # pages 0-1 on the device
    insert(kv, a, tier=HOST)  # pages 2-7 only in host memory (pages 0-1 gain a host copy)
    ex = explain_prefix(kv, a + [9])
    assert [(s.start, s.end, s.tier) for s in ex.spans] == [(0, 8, "device"), (8, 32, "host")]
    assert ex.hit_tokens == 32 and ex.hit_tokens_by_tier == {"device": 8, "host": 24}


def test_explain_tells_evicted_from_never_cached(kv):
    a = tokens(16, seed=6)
    h = insert(kv, a)
    kv.tree.evict(DEVICE, 4, kv._release)
    ex = explain_prefix(kv, a, recently_cached=set(h))
    assert ex.reason == "evicted" and ex.hit_tokens == 0
    assert explain_prefix(kv, a, recently_cached=set()).reason == "not_cached"


def test_explain_salt_and_disabled_cache(kv):
    a = tokens(16, seed=7)
    insert(kv, a, salt="x")
    assert explain_prefix(kv, a, salt="y", other_salts=[None, "x"]).reason == "salt"
    assert explain_prefix(kv, a, salt="x").reason == "last_token"
    off = KVCacheManager(PageAllocator(8), PS, "model-id", enable_prefix_cache=False)
    assert explain_prefix(off, a).reason == "prefix_cache_disabled"


def test_metrics_show_a_restarted_servers_l3_load(tiny_llama, tmp_path):
    prompt = list(range(10, 71))  # 15 full pages looked up
    eng = make_engine(tiny_llama, disk_cache_dir=str(tmp_path), host_cache_gb=0)
    eng.run_to_completion([eng.add_request(prompt, SamplingParams(max_tokens=1))])
    eng.shutdown()
    srv = start_server(tiny_llama, {"disk_cache_dir": str(tmp_path), "host_cache_gb": 0})
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": srv.server_obj.model_name, "prompt": prompt, "max_tokens": 1})
        usage = r.json()["usage"]
        text = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    page = srv.async_engine.engine.tiers.disk_page_nbytes
    assert usage["prompt_tokens_details"]["cached_tokens_by_tier"] == {"disk": 60}
    load = usage["kv_load"]  # this request's own load: 15 pages read from L3
    assert load["bytes_by_tier"] == {"disk": 15 * page} and set(load["seconds_by_tier"]) == {"disk"}
    assert 0 < load["seconds_by_tier"]["disk"] <= load["seconds"]
    assert load["gb_per_s"] == pytest.approx(15 * page / load["seconds"] / 1e9)
    assert f'deepinfer:kv_load_bytes_by_tier_total{{model_name="{srv.server_obj.model_name}",' \
           f'tier="disk"}} {15 * page}' in text
    assert "deepinfer:kv_load_seconds_count" in text
    count = [l for l in text.splitlines() if l.startswith("deepinfer:kv_load_throughput_gb_per_s_count")]
    assert count and count[0].endswith(" 1")

