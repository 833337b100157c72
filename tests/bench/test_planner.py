"""Capacity planner: hand-computed LRU / tier hit rates, page keys, agreement with the engine."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench.ideal import ideal_hits
from deepinfer.bench.plan_report import write_plan_report
from deepinfer.bench.replay import block_digests, page_keys, replay
from deepinfer.bench.sweep import (PlanReport, format_tokens, log_grid, parse_tokens, plan,
                                   smallest_sizes)
from deepinfer.bench.tokens import TokenBlocks
from deepinfer.bench.traces import TraceRequest
from deepinfer.kv.hashing import chain_hashes


def req(i, blocks, n, out=1, bs=4, session=None, ns="h"):
    return TraceRequest(arrival_s=float(i), session_id=session, block_ids=list(blocks),
                        block_size=bs, input_length=n, output_length=out, namespace=ns,
                        request_id=f"r{i}")


# Page = block = 4 tokens, one output token (no reply pages: the KV of prompt + output - 1
# tokens = the prompt), no chunking. Each prompt ends in a unique 1-token block, so its full
# pages are its shared blocks and at most (len - 1) // 4 pages can hit.
A, B, C, D, E, F, G, H = range(1, 9)
HAND = [req(0, [A, B, 100], 9), req(1, [C, D, 101], 9), req(2, [A, B, E, 102], 13),
        req(3, [F, G, H, 103], 13), req(4, [A, B, E, 104], 13), req(5, [C, D, 105], 9)]
HAND_INPUT = 9 + 9 + 13 + 13 + 13 + 9  # 66


def test_hand_trace_ideal():
    # infinite cache: r2 hits A B (8); r4 hits A B E (12); r5 hits C D (8)
    assert ideal_hits(HAND).hit_tokens.tolist() == [0, 0, 8, 0, 12, 8]
    r = replay(HAND, page_size=4, l1_tokens=None, chunk_tokens=64, per_request=True)
    assert r.per_request_hits == [0, 0, 8, 0, 12, 8]
    assert r.hit_tokens == 28 and r.input_tokens == HAND_INPUT and r.evicted_pages == 0


def test_hand_trace_lru_six_pages():
    """L1 = 6 pages (24 tokens), worked out by hand.

    r0 [A B x]: miss; caches node AB (2 pages), the partial page is freed -> 2 used.
    r1 [C D x]: miss; caches CD -> 4 used.
    r2 [A B E x]: hits AB (8); needs 2 pages (2 free); caches E under AB -> 5 used.
    r3 [F G H x]: miss; needs 4 pages, 1 free: evicts the LRU leaves CD (2, used at r1) then
       E (1, used at r2); caches FGH -> 5 used.
    r4 [A B E x]: hits AB (8), E was evicted; needs 2 pages, 1 free: evicts FGH (3); caches E.
    r5 [C D x]: CD was evicted: miss.
    """
    r = replay(HAND, page_size=4, l1_tokens=24, chunk_tokens=64, per_request=True)
    assert r.per_request_hits == [0, 0, 8, 0, 8, 0]
    assert r.hit_tokens == 16 and r.hit_rate == pytest.approx(16 / 66)
    assert r.evicted_pages == 2 + 1 + 3
    assert r.hit_tokens_by_tier == {"device": 16}


def test_hand_trace_with_l2_write_back():
    """Same L1, plus an 8-page L2, write-back: L1 evictions (CD, E, then FGH) go to L2.

    r4 loads E back from L2 (hits 8 in L1 + 4 from L2); r5 loads CD (8 from L2).
    """
    r = replay(HAND, page_size=4, l1_tokens=24, l2_tokens=32, policy="write_back",
               chunk_tokens=64, per_request=True)
    assert r.per_request_hits == [0, 0, 8, 0, 12, 8]
    assert r.hit_tokens_by_tier == {"device": 16, "host": 12}
    assert r.pages_moved["device->host"] == 2 + 1 + 3
    assert r.pages_moved["host->device"] == 1 + 2
    assert r.pages_moved["device->disk"] == 0


def test_hand_trace_with_l3_write_through():
    """No L2, an 8-page L3, write-through: every adopted node is written (AB, CD, E, FGH =
    8 pages); r4 / r5 load E / CD from disk."""
    r = replay(HAND, page_size=4, l1_tokens=24, l3_tokens=32, policy="write_through",
               chunk_tokens=64, per_request=True, kv_bytes_per_token=10)
    assert r.per_request_hits == [0, 0, 8, 0, 12, 8]
    assert r.hit_tokens_by_tier == {"device": 16, "disk": 12}
    assert r.pages_moved["device->disk"] == 8
    assert r.pages_moved["disk->device"] == 3
    assert r.bytes_moved["disk->device"] == 3 * 4 * 10


def test_request_that_does_not_fit_is_counted():
    big = [req(0, [A, B, C, D, E], 20)]
    r = replay(big, page_size=4, l1_tokens=8, chunk_tokens=64)
    assert r.failed_requests == 1 and r.hit_tokens == 0


def test_concurrency_holds_pages_longer():
    # two requests in flight: r1 is admitted while r0 still holds its 3 pages, so a 5-page
    # L1 cannot take both (r0 is finished first), and nothing changes with infinite room
    trace = [req(0, [A, B, 100], 9), req(1, [A, B, 101], 9), req(2, [A, B, 102], 9)]
    one = replay(trace, page_size=4, l1_tokens=None, chunk_tokens=64, per_request=True)
    two = replay(trace, page_size=4, l1_tokens=None, chunk_tokens=64, per_request=True,
                 concurrency=2)
    assert one.per_request_hits == two.per_request_hits == [0, 8, 8]
    tight = replay(trace, page_size=4, l1_tokens=20, chunk_tokens=64, concurrency=3)
    assert tight.failed_requests == 0 and tight.hit_tokens == 16


@pytest.mark.parametrize("ps", [1, 2, 4, 8, 16, 3])
def test_page_keys_equal_iff_token_prefixes_equal(ps):
    """Planner keys vs the engine's chained token-page hashes on the same trace tokens."""
    trace = [req(0, [1, 2, 3], 21, bs=8), req(1, [1, 2, 4, 5], 30, bs=8),
             req(2, [1, 2, 3], 24, bs=8), req(3, [1, 9], 16, bs=8), req(4, [7], 5, bs=8),
             req(5, [1, 2, 3, 6], 29, bs=8)]
    blocks = TokenBlocks(1000)
    planner, engine = [], []
    for r in trace:
        keys = page_keys(block_digests(r), r.block_size, r.hashed_tokens, ps)
        toks = blocks.request_tokens(r)
        hashes = chain_hashes(toks, ps, b"root")
        assert len(keys) == len(hashes)
        planner += [(p, k) for p, k in enumerate(keys)]
        engine += [(p, h) for p, h in enumerate(hashes)]
    for (p1, k1), (q1, h1) in zip(planner, engine):
        for (p2, k2), (q2, h2) in zip(planner, engine):
            assert (k1 == k2) == (h1 == h2)


def _agree_trace():
    def r(i, s, blocks, n, out):
        return req(i, blocks, n, out=out, bs=8, session=s, ns="agree")

    # 5 sessions, shared system blocks (1, 2) / (50, 51), growing turns, partial last blocks
    # (a block id seen partial then full: B's block 20), 2-7 reply tokens per request
    return [r(0, "A", [1, 2, 10, 11], 30, 5), r(1, "B", [1, 2, 20], 22, 3),
            r(2, "C", [50, 51, 52, 53], 32, 4), r(3, "A", [1, 2, 10, 12, 13], 38, 4),
            r(4, "B", [1, 2, 20, 21], 30, 6), r(5, "C", [50, 51, 52, 53, 54, 55], 44, 2),
            r(6, "A", [1, 2, 10, 12, 13, 14], 48, 3), r(7, "B", [1, 2, 20, 21, 22], 40, 4),
            r(8, "D", [1, 2, 10, 12], 27, 5), r(9, "C", [50, 51, 52, 53, 54, 55, 56], 52, 4),
            r(10, "A", [1, 2, 10, 12, 13, 14, 15], 56, 2), r(11, "E", [50, 51], 13, 7)]


# (num_pages, cache_policy, L2 pages, L3 on): L1 only at two pool sizes (20 pages: heavy
# eviction, 200: none), then the lower tiers with the engine's own TierIO
AGREE_CASES = [
    (20, "write_through", 0, False), (200, "write_through", 0, False),
    (20, "write_back", 8, False),
    (20, "write_through", 10, True), (20, "selective", 10, True),
]


@pytest.mark.parametrize("num_pages,policy,l2_pages,l3", AGREE_CASES)
def test_planner_agrees_with_engine(tiny_llama, tmp_path, num_pages, policy, l2_pages, l3):
    """Per-request cached tokens (and per tier), evictions: engine (max_num_seqs=1, trace
    order) == planner (concurrency 1) at the same page size, pool and tier sizes, with
    chunked prefill (16 tokens) and reply pages."""
    from deepinfer.config import EngineConfig
    from deepinfer.engine import LLMEngine
    from deepinfer.kv.radix import DISK, HOST
    from deepinfer.sampling_params import SamplingParams

    slot = 2 * 2 * 2 * 16 * 4 * 4  # layers * (k, v) * kv heads * head dim * page * fp32
    eng = LLMEngine(EngineConfig(
        model=str(tiny_llama), page_size=4, num_pages=num_pages, max_num_seqs=1,
        max_num_batched_tokens=16, progress=False, cache_policy=policy,
        host_cache_gb=(l2_pages * slot + 1) / 2**30 if l2_pages else 0.0,
        enable_disk_cache=l3, disk_cache_dir=str(tmp_path / "l3"), disk_cache_gb=0.1))
    cap = eng.kv.tiers.capacity if eng.kv.tiers is not None else [0, 0, 0]
    assert cap[HOST] == l2_pages
    trace = _agree_trace()
    blocks = TokenBlocks(eng.hf_config.vocab_size, low=3)
    got, got_tiers = [], {}
    try:
        for t in trace:
            q = eng.add_request(blocks.request_tokens(t), SamplingParams(
                max_tokens=t.output_length, temperature=0.0, ignore_eos=True))
            while not q.is_finished:
                eng.step()
            got.append(q.num_cached_tokens)
            for k, v in q.cached_tokens_by_tier.items():
                got_tiers[k] = got_tiers.get(k, 0) + v
        stats = eng.stats()
    finally:
        eng.shutdown()
    res = replay(trace, page_size=4, l1_tokens=(num_pages - 1) * 4, l2_tokens=cap[HOST] * 4,
                 l3_tokens=cap[DISK] * 4, policy=policy, chunk_tokens=16, per_request=True)
    assert res.per_request_hits == got
    assert res.evicted_pages == stats["evicted_pages"]
    assert res.hit_tokens == stats["prefix_cache_hits"]
    assert res.hit_tokens_by_tier == {k: v for k, v in got_tiers.items() if v}
    if num_pages == 200:
        assert res.evicted_pages == 0
    else:
        assert res.evicted_pages > 0
    if l2_pages or l3:
        assert sum(v for k, v in res.hit_tokens_by_tier.items() if k != "device") > 0


def test_plan_grid_smallest_and_report(tmp_path):
    rep = plan(HAND, page_sizes=[4], l1=[8, 16, 24, 40, 64], l2=[0, 32], target=0.4,
               name="hand", progress=False, chunk_tokens=64)
    assert rep.trace_ideal_hit_rate == pytest.approx(28 / 66)
    assert rep.unbounded[4].hit_tokens == 28
    l1_only = {p.l1_tokens: p.hit_tokens for p in rep.points if p.l2_tokens == 0}
    assert l1_only[24] == 16 and l1_only[64] == 28
    s = rep.smallest[4]
    first = min(k for k, v in l1_only.items() if v / 66 >= 0.4)
    assert s["l1_only"]["l1_tokens"] == first
    assert all(d["hit_rate"] >= 0.4 for d in s["pareto"])
    doc = write_plan_report(tmp_path, rep)
    on_disk = json.loads((tmp_path / "plan.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    back = PlanReport.from_dict(on_disk)
    assert back.as_dict() == doc
    assert on_disk["unbounded"]["4"]["hit_tokens"] == 28
    md = (tmp_path / "plan.md").read_text()
    assert "42.4%" in md  # the ideal, 28 / 66
    assert (tmp_path / "hit_rate_vs_capacity.png").stat().st_size > 1000


def test_smallest_sizes_pareto():
    from deepinfer.bench.replay import ReplayResult

    def pt(a, b, hits):
        return ReplayResult(page_size=4, l1_tokens=a, l2_tokens=b, l3_tokens=0, concurrency=1,
                            requests=1, input_tokens=100, hit_tokens=hits, hit_tokens_by_tier={},
                            evicted_pages=0, pages_moved={}, failed_requests=0, seconds=0.0)

    pts = [pt(10, 0, 50), pt(20, 0, 80), pt(40, 0, 95), pt(10, 100, 92), pt(20, 100, 96),
           pt(10, 50, 85)]
    s = smallest_sizes(pts, 0.9)
    assert s["l1_only"]["l1_tokens"] == 40
    assert [(d["l1_tokens"], d["l2_tokens"]) for d in s["pareto"]] == [(10, 100), (40, 0)]


def test_units():
    assert parse_tokens("1M") == 1_000_000 and parse_tokens("64k") == 64_000
    assert parse_tokens("1.5g") == 1_500_000_000 and parse_tokens("4096") == 4096
    assert format_tokens(2_000_000) == "2M" and format_tokens(None) == "inf"
    g = log_grid(1_000_000, 200_000_000, 8)
    assert g[0] == 1_000_000 and g[-1] == 200_000_000 and len(g) == 8


def test_cli_plan_cache(tmp_path, capsys):
    from deepinfer.bench.cli import main

    path = tmp_path / "hand_blk4.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"timestamp": r.arrival_s * 1000, "input_length": r.input_length,
                                 "output_length": 1, "hash_ids": r.block_ids}) + "\n"
                     for r in HAND)
    rc = main(["plan-cache", "--trace", str(path), "--page-sizes", "4", "--l1", "24,64",
               "--chunk-tokens", "64", "--target", "40%", "--out", str(tmp_path / "out"),
               "--run", "x", "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "x" / "plan.json").read_text())
    rates = {p["l1_tokens"]: p["hit_tokens"] for p in doc["points"]}
    assert rates == {24: 16, 64: 28}
    assert doc["smallest"]["4"]["l1_only"]["l1_tokens"] == 64
    assert "Smallest sizes reaching 40.0%" in capsys.readouterr().out


def test_real_trace_unbounded_close_to_ideal(real_file):
    """On a real trace, the planner with infinite L1 never beats the ideal and loses only
    what whole pages and the always-computed last token cost."""
    from deepinfer.bench.traces import load_trace

    trace = load_trace(real_file("derived_taubench_airline_blk64.jsonl"), max_requests=400)
    ideal = ideal_hits(trace)
    r = replay(trace, page_size=64, l1_tokens=None, per_request=True)
    assert all(h <= i for h, i in zip(r.per_request_hits, ideal.hit_tokens.tolist()))
    assert r.hit_rate > 0.9 * ideal.hit_rate
