"""The direct route of prefill/decode disaggregation (``--pd-transfer direct``) with real
processes on loopback: the decode worker reads the prompt's pages from the prefill worker's
memory over Mooncake's transfer engine (TCP), with Redis as the store the route falls back to.
Greedy outputs equal a co-located server's over multi-turn chats, streamed or not; the decode
side's usage says which pages came from the prefill worker; a page corrupted in the prefill
worker's buffer is a counted miss and recomputed; a prefill worker killed between its prefill
and the pull costs recomputation, not an error."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
from pd_helpers import PS, Worker, colocated, run_conversations  # noqa: F401 (a fixture)
from store_services import SERVICES

from deepinfer.server.config import ServerConfig
from deepinfer.server.pd_decode import PREFILL_FIELDS, PREFILL_HEADER, TRANSFER_HEADER

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "Prefix caching reuses the key value cache of earlier requests. " * 3


@pytest.fixture(scope="module")
def direct(tiny_llama, tmp_path_factory):
    """A decode worker and a prefill worker forwarding to it, both ``--pd-transfer direct``,
    over one Redis (the fallback route)."""
    d = tmp_path_factory.mktemp("pd-direct")
    redis = SERVICES["redis"](d).start()
    store = ("--kv-store", redis.url, "--pd-transfer", "direct")
    decode = Worker(tiny_llama, d / "decode.log", "--role", "decode", "--no-disk-cache", *store)
    prefill = Worker(tiny_llama, d / "prefill.log", "--role", "prefill", "--decode-worker",
                     decode.url, "--no-disk-cache", *store)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()
        redis.kill()


def handover(prefill: Worker, salt: str) -> tuple[dict, dict]:
    """``/internal/prefill`` of a completion: (its counts, the request for the decode worker)."""
    req = {"prompt": f"[{salt}] {PROMPT}", "max_tokens": 6, "temperature": 0}
    r = httpx.post(prefill.url + "/internal/prefill",
                   json={"endpoint": "completion", "request": req}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json(), req


def decode_completion(decode: Worker, counts: dict, req: dict) -> dict:
    headers = {PREFILL_HEADER: json.dumps({k: counts[k] for k in PREFILL_FIELDS}),
               TRANSFER_HEADER: json.dumps(counts["transfer"])}
    r = httpx.post(decode.url + "/v1/completions", json=req, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_outputs_match_colocated_and_the_pages_come_from_the_prefill_worker(direct, colocated):
    prefill, decode = direct
    ref = run_conversations(colocated.url, "a")
    got = run_conversations(prefill.url, "a")
    assert [[t for t, _ in conv] for conv in got] == [[t for t, _ in conv] for conv in ref]
    for conv in got:
        for turn, (_, u) in enumerate(conv):
            n = u["prompt_tokens"]
            details = u["prompt_tokens_details"]
            by_tier = details["cached_tokens_by_tier"]
            # the decode worker computed only the tail partial page (and the last token)
            assert details["cached_tokens"] == (n - 1) // PS * PS
            # its L3 pages came from the prefill worker or, where a concurrent conversation's
            # pull held the shared template start, from that pull too: never computed
            from_worker = details["cached_tokens_from_prefill_worker"]
            assert from_worker + details["cached_tokens_from_store"] == by_tier.get("disk", 0)
            pre = u["prefill_worker"]
            assert pre["pages"] == n // PS and pre["pages_exported"] == pre["pages"]
            assert pre["pages_published"] == 0 and pre["pages_failed"] == 0
            # only the pages the decode worker's tree lacked crossed the link
            assert pre["pages_pulled"] + pre["pages_held"] == pre["pages"]
            assert turn == 0 or pre["pages_held"] > 0  # its earlier turns: never pulled
            if turn == 0:  # a new conversation: nearly all of it sent by the prefill worker
                assert from_worker >= 0.9 * n
            else:  # the earlier turns are still in the decode worker's device pool
                assert by_tier.get("device", 0) > 0 and from_worker > 0
    assert decode.metric("pd_transfer_fallbacks_by_reason_total") == 0
    assert decode.metric("pd_transfer_checksum_failures_total") == 0
    # every pull releases its export: the decode worker posts that in the background, so the
    # last ones may land after the replies
    t0 = time.monotonic()
    while prefill.metric("pd_transfer_released_total") < 9:
        assert time.monotonic() - t0 < 120, "the decode worker did not release every export"
        time.sleep(0.1)
    assert prefill.metric("pd_transfer_fallbacks_by_reason_total") == 0


def test_a_page_corrupted_in_the_prefill_workers_buffer_is_recomputed(direct, colocated):
    from mooncake.engine import TransferEngine

    prefill, decode = direct
    counts, req = handover(prefill, "corrupt")
    t = counts["transfer"]
    bad = t["pages"] // 2  # flip bytes in the middle of this page's payload
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    junk = np.full(64, 0xA5, dtype=np.uint8)
    assert te.register_memory(junk.ctypes.data, junk.nbytes) == 0
    target = t["address"] + bad * t["page_bytes"] + t["page_bytes"] // 2
    assert te.transfer_sync_write(t["session"], junk.ctypes.data, target, junk.nbytes) == 0
    before = decode.metric("pd_transfer_checksum_failures_total")
    got = decode_completion(decode, counts, req)
    ref = httpx.post(colocated.url + "/v1/completions", json=req, timeout=120).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert decode.metric("pd_transfer_checksum_failures_total") == before + 1
    details = got["usage"]["prompt_tokens_details"]
    n = got["usage"]["prompt_tokens"]
    # the pages before the bad one came from the prefill worker; the bad one was a miss, so
    # the store's copy (the prefill's write-through) or the decode worker's own compute
    # replaced it, and the pages after it followed from wherever the load went on
    assert bad * PS <= details["cached_tokens_from_prefill_worker"] < n // PS * PS
    assert got["usage"]["prefill_worker"]["pages_pulled"] == t["pages"]  # a new prompt: all


def test_bad_transfer_headers_are_a_400(direct):
    prefill, decode = direct
    counts, req = handover(prefill, "headers")
    for bad in ("[]", '{"session": 1}', json.dumps({**counts["transfer"], "pages": -1})):
        r = httpx.post(decode.url + "/v1/completions", json=req,
                       headers={TRANSFER_HEADER: bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == TRANSFER_HEADER, r.text
    with pytest.raises(ValueError, match="pd-transfer"):
        ServerConfig(pd_transfer="direct")  # role both: nothing to transfer
    with pytest.raises(ValueError, match="pd_transfer"):
        ServerConfig(role="decode", pd_transfer="rdma")


def test_a_prefill_worker_killed_before_the_pull_costs_recomputation(direct, colocated):
    """(Last: it kills the module's prefill worker.)"""
    prefill, decode = direct
    counts, req = handover(prefill, "killed")
    prefill.proc.kill()
    prefill.proc.wait(30)
    before = decode.metric("pd_transfer_fallbacks_by_reason_total")
    got = decode_completion(decode, counts, req)
    ref = httpx.post(colocated.url + "/v1/completions", json=req, timeout=120).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens_from_prefill_worker"] == 0
    assert got["usage"]["prefill_worker"]["pages_pulled"] == 0
    assert decode.metric("pd_transfer_fallbacks_by_reason_total") == before + 1
