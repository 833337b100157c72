"""Prefill/decode disaggregation with real processes on loopback: a prefill worker
(``--role prefill --decode-worker URL``) and a decode worker (``--role decode``, no local
directory: its L3 is the store) over a real Mooncake Store or Redis, against a co-located
``both`` server. Greedy outputs are the same, streamed or not, over multi-turn chats; the
decode side's usage says exactly where its prompt came from; a client that leaves mid-stream
ends the request on the decode worker; a store killed mid-run costs recomputation, no error."""

from __future__ import annotations

import time

import httpx
import pytest
from pd_helpers import PS, Worker, colocated, run_conversations  # noqa: F401 (a fixture)

from deepinfer.config import EngineConfig
from deepinfer.server.config import ServerConfig
from deepinfer.server.pd import check_role

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pd(store_service, tiny_llama, tmp_path_factory):
    """A decode worker (its L3 is the store) and a prefill worker forwarding to it."""
    d = tmp_path_factory.mktemp("pd")
    store = ["--kv-store", store_service.url] + [
        a for k, v in store_service.options.items() for a in ("--kv-store-option", f"{k}={v}")]
    decode = Worker(tiny_llama, d / "decode.log", "--role", "decode", "--no-disk-cache",
                    *store)
    prefill = Worker(tiny_llama, d / "prefill.log", "--role", "prefill", "--decode-worker",
                     decode.url, "--disk-cache-dir", str(d / "prefill-l3"), *store)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def test_outputs_match_colocated_and_the_decode_side_reads_the_prompt_from_the_store(
        pd, colocated):
    prefill, decode = pd
    ref = run_conversations(colocated.url, "a")
    got = run_conversations(prefill.url, "a")
    assert [[t for t, _ in conv] for conv in got] == [[t for t, _ in conv] for conv in ref]
    for conv, ref_conv in zip(got, ref):
        for turn, ((_, u), (_, ref_u)) in enumerate(zip(conv, ref_conv)):
            n = u["prompt_tokens"]
            assert n == ref_u["prompt_tokens"]  # the same prompt ids (shared reply records)
            usable = (n - 1) // PS * PS  # a hit leaves at least the last token to compute
            details = u["prompt_tokens_details"]
            by_tier = details["cached_tokens_by_tier"]
            # the decode worker computed only the tail partial page (and the last token)
            assert u["prompt_cache_hit_tokens"] == details["cached_tokens"] == usable
            assert sum(by_tier.values()) == usable
            # its L3 is the store alone: every L3 token came from there
            assert details["cached_tokens_from_store"] == by_tier.get("disk", 0)
            if turn == 0:  # a new conversation: >= 90% of it from the store, the rest is the
                # chat template's start, which a concurrent conversation loaded a moment before
                assert set(by_tier) <= {"device", "disk"} and by_tier["disk"] >= 0.9 * n
            else:  # the earlier turns are still in the decode worker's device pool
                assert by_tier.get("device", 0) > 0 and by_tier.get("disk", 0) > 0
            pre = u["prefill_worker"]
            assert pre["prompt_tokens"] == n and pre["pages"] == n // PS
            assert pre["pages_failed"] == 0
            assert pre["pages_present"] + pre["pages_published"] == pre["pages"]
            assert pre["cached_tokens"] + pre["computed_tokens"] == n
            if turn > 0:  # the prefill worker found the earlier turns (its own and the reply's)
                assert pre["pages_present"] > 0 and pre["cached_tokens"] > 0
    assert decode.metric("requests_aborted_total") == 0


def test_internal_prefill_answers_the_counts_and_publishes_the_pages(pd):
    prefill, decode = pd
    body = {"endpoint": "completion",
            "request": {"prompt": "Prefix caching reuses the key value cache of earlier "
                                  "requests. " * 3, "max_tokens": 4}}
    first = httpx.post(prefill.url + "/internal/prefill", json=body, timeout=120).json()
    n = first["prompt_tokens"]
    assert first["pages"] == n // PS and first["pages_failed"] == 0
    assert first["pages_published"] == first["pages"] and first["pages_present"] == 0
    assert first["cached_tokens"] == 0 and first["computed_tokens"] == n
    again = httpx.post(prefill.url + "/internal/prefill", json=body, timeout=120).json()
    assert again["pages_present"] == again["pages"] and again["pages_published"] == 0
    assert again["cached_tokens"] == (n - 1) // PS * PS
    # the decode worker (no prefill of its own) finds every usable page in the store
    r = httpx.post(decode.url + "/v1/completions", json={**body["request"], "temperature": 0},
                   timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens_from_store"] == (n - 1) // PS * PS
    assert "prefill_worker" not in r["usage"]
    bad = httpx.post(prefill.url + "/internal/prefill", json={"endpoint": "x", "request": {}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "endpoint"
    bad = httpx.post(prefill.url + "/internal/prefill",
                     json={"endpoint": "chat", "request": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = httpx.post(decode.url + "/v1/completions", json=body["request"],
                     headers={"x-deepinfer-prefill": '{"pages": -1}'})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-deepinfer-prefill"


def test_role_flags_are_checked():
    with pytest.raises(ValueError, match="role"):
        ServerConfig(role="decoder")
    with pytest.raises(ValueError, match="--decode-worker"):
        ServerConfig(role="decode", decode_workers=["http://127.0.0.1:1"])
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match="--kv-store"):
            check_role(ServerConfig(role=role), EngineConfig())
    check_role(ServerConfig(role="decode"), EngineConfig(kv_store="redis://127.0.0.1:1"))


def test_anthropic_messages_go_through_the_prefill_worker_too(pd, colocated):
    prefill, _ = pd
    body = {"model": colocated.server_obj.model_name, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Prefix caching reuses the key value "
                          "cache of earlier requests in a conversation. Why?"}]}
    got = httpx.post(prefill.url + "/v1/messages", json=body, timeout=120)
    ref = httpx.post(colocated.url + "/v1/messages", json=body, timeout=120)
    assert got.status_code == ref.status_code == 200, got.text
    assert got.json()["content"] == ref.json()["content"]
    prompt = lambda u: u["input_tokens"] + u["cache_read_input_tokens"] + \
        u["cache_creation_input_tokens"]  # noqa: E731
    assert prompt(got.json()["usage"]) == prompt(ref.json()["usage"])
    assert got.json()["usage"]["cache_read_input_tokens"] > 0  # the decode side read the store


def test_a_client_leaving_mid_stream_ends_the_request_on_the_decode_worker(pd):
    prefill, decode = pd
    before = decode.metric("requests_aborted_total")
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", prefill.url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks: the decode side is streaming
        assert any('"content"' in line for line in got)
    t0 = time.monotonic()
    while decode.metric("requests_aborted_total") < before + 1:
        assert time.monotonic() - t0 < 60, "the decode worker did not abort the request"
        time.sleep(0.2)
    while decode.metric("num_requests_running") > 0:
        assert time.monotonic() - t0 < 60
        time.sleep(0.2)


def test_a_store_killed_mid_run_costs_recomputation_not_errors(pd, colocated, store_service):
    if store_service.url.startswith("mooncake"):
        pytest.skip("Mooncake's client may crash its process after the master dies "
                    "(see tests/kv/tiers/test_shared_store.py); Redis covers the case")
    prefill, decode = pd
    store_service.kill()
    ref = run_conversations(colocated.url, "b")
    got = run_conversations(prefill.url, "b")  # every request answered 200 (asserted in chat)
    assert [[t for t, _ in conv] for conv in got] == [[t for t, _ in conv] for conv in ref]
    for conv in got:
        for _, u in conv:
            assert u["prompt_tokens_details"]["cached_tokens_from_store"] == 0
            assert u["prefill_worker"]["pages_published"] == 0
            assert u["prefill_worker"]["pages_failed"] == u["prefill_worker"]["pages"]
