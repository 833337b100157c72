"""Ideal (infinite cache) hit rate: hand-computed traces, a reference model, real traces."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.bench.ideal import IdealIndex, ideal_hits, ideal_hits_tokens, token_block_ids
from deepinfer.bench.traces import TraceRequest, load_trace


def req(ids, length, bs=4, ns="t", t=0.0):
    return TraceRequest(arrival_s=t, session_id=None, block_ids=list(ids), block_size=bs,
                        input_length=length, output_length=1, namespace=ns)


def test_full_repeat_and_branch():
    # blocks of 4; request 0: 4+4+2 tokens, nothing cached
    res = ideal_hits([req([1, 2, 3], 10), req([1, 2, 3], 10), req([1, 2, 4, 5], 16)])
    assert res.hit_tokens.tolist() == [0, 10, 8]
    assert res.total_input_tokens == 36
    assert res.hit_rate == pytest.approx(18 / 36)


def test_partial_last_block_counts_real_tokens():
    # request 0 = 6 tokens: block 7 holds 2; request 1 repeats it: 6 hit tokens, not 8
    res = ideal_hits([req([5, 7], 6), req([5, 7], 6)])
    assert res.hit_tokens.tolist() == [0, 6]
    # a later request whose block 7 is full (4 tokens) only hits the 2 tokens ever seen,
    # and the run stops there even though block 8 continues the chain afterwards
    res = ideal_hits([req([5, 7], 6), req([5, 7, 8], 12), req([5, 7, 8], 12)])
    assert res.hit_tokens.tolist() == [0, 4 + 2, 12]


def test_divergence_then_reconvergence_is_not_a_hit():
    # 1-2-3-4 then 1-9-3-4: ids 3, 4 re-appear after a divergence: only block 1 hits
    res = ideal_hits([req([1, 2, 3, 4], 16), req([1, 9, 3, 4], 16)])
    assert res.hit_tokens.tolist() == [0, 4]
    # a chain starting elsewhere never hits, even with every later id seen before
    res = ideal_hits([req([1, 2, 3], 12), req([6, 2, 3], 12), req([6, 2, 3], 12)])
    assert res.hit_tokens.tolist() == [0, 0, 12]


def test_prefix_of_earlier_request_hits_and_extension():
    res = ideal_hits([req([1, 2, 3, 4], 16), req([1, 2], 8), req([1, 2, 3, 4, 5, 6], 22)])
    assert res.hit_tokens.tolist() == [0, 8, 16]
    assert res.unique_blocks == 6


def test_namespaces_never_share():
    res = ideal_hits([req([1, 2], 8, ns="a"), req([1, 2], 8, ns="b"), req([1, 2], 8, ns="a")])
    assert res.hit_tokens.tolist() == [0, 0, 8]


def test_unhashed_tail_never_hits():
    # kv-cache-tester style: 70 tokens, one hashed 64-token block, 6-token tail
    res = ideal_hits([req([1], 70, bs=64), req([1], 70, bs=64)])
    assert res.hit_tokens.tolist() == [0, 64]
    assert res.hit_rate == pytest.approx(64 / 140)


def test_empty_and_zero_length():
    assert ideal_hits([]).hit_rate == 0.0
    res = ideal_hits([req([], 0), req([1], 0)])
    assert res.hit_tokens.tolist() == [0, 0]


def test_split_inside_a_run_then_both_branches_hit():
    res = ideal_hits([
        req([1, 2, 3, 4, 5], 20),
        req([1, 2, 3, 8, 9], 20),   # splits the first run after 3 blocks
        req([1, 2, 3, 4, 5], 20),
        req([1, 2, 3, 8, 9], 18),   # partial last block of a full-seen block: 2 tokens
    ])
    assert res.hit_tokens.tolist() == [0, 12, 20, 18]


def _reference(requests):
    """Obviously-correct model: a dict keyed by the whole chain tuple."""
    seen: dict[tuple, int] = {}
    out = []
    for r in requests:
        bs, left, hits, matching = r.block_size, r.input_length, 0, True
        for k in range(len(r.block_ids)):
            if left <= 0:
                break
            need = min(bs, left)
            left -= need
            key = (r.namespace, *r.block_ids[: k + 1])
            have = seen.get(key)
            if matching and have is not None:
                hits += min(have, need)
                matching = have >= need
            else:
                matching = False
            seen[key] = max(have or 0, need)
        out.append(hits)
    return out


@st.composite
def _traces(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 25))
    out = []
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 4), max_size=7))
        full = len(ids) * bs
        length = draw(st.integers(max(0, full - bs + 1) if ids else 0, full)) if ids else 0
        if draw(st.booleans()):
            length = draw(st.integers(0, full + 3))  # short prompts and unhashed tails too
        out.append(req(ids, length, bs=bs, ns=draw(st.sampled_from("ab"))))
    return out


@settings(max_examples=60, deadline=None)
@given(_traces())
def test_matches_reference_model(trace):
    assert ideal_hits(trace).hit_tokens.tolist() == _reference(trace)


def test_incremental_index_equals_batch():
    trace = [req([1, 2, 3], 12), req([1, 2, 9], 10), req([1, 2, 3, 4], 16)]
    idx = IdealIndex()
    inc = [idx.lookup_insert(r.namespace, r.block_ids, r.block_size, r.input_length)
           for r in trace]
    assert inc == ideal_hits(trace).hit_tokens.tolist() == [0, 8, 12]


def test_token_prompts():
    a = list(range(10))
    b = list(range(8)) + [99, 98]
    res = ideal_hits_tokens([a, a, b, a[:6]], block_size=4)
    # a: 4+4+2; repeat hits 10; b shares 2 full blocks; a[:6] ends with a 2-token partial
    # block whose content differs from a's (different ids): 4
    assert res.hit_tokens.tolist() == [0, 10, 8, 4]
    assert token_block_ids(a, 4)[:2] == token_block_ids(b, 4)[:2]


def test_real_mooncake_conversation_is_fast(real_file):
    path = real_file("mooncake_conversation_trace.jsonl")
    t0 = time.perf_counter()
    res = ideal_hits(load_trace(path))
    elapsed = time.perf_counter() - t0
    assert len(res.input_tokens) == 12031
    assert res.total_input_tokens == 144_793_823
    assert res.total_hit_tokens == 54_098_411  # 37.4 %, paper: ~40 % (conversation)
    assert elapsed < 30
