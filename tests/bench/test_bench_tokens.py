"""Hash ids -> deterministic token blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from deepinfer.bench.ideal import ideal_hits, ideal_hits_tokens
from deepinfer.bench.tokens import TokenBlocks, chain_digests
from deepinfer.bench.traces import TraceRequest


def req(ids, n, bs=8, ns="ns", rid="r"):
    return TraceRequest(arrival_s=0.0, session_id=None, block_ids=ids, block_size=bs,
                        input_length=n, output_length=1, namespace=ns, request_id=rid)


def test_equal_prefix_equal_tokens_and_divergence():
    tb = TokenBlocks(1000)
    a = tb.request_tokens(req([1, 2, 3], 24))
    b = tb.request_tokens(req([1, 2, 4], 24))
    assert len(a) == 24 and all(0 <= t < 1000 for t in a)
    assert a[:16] == b[:16]
    assert a[16:] != b[16:]
    # re-convergence: block 3 after a different prefix gets different tokens
    c = tb.request_tokens(req([9, 2, 3], 24))
    assert c[8:16] != a[8:16] and c[16:] != a[16:]
    # a fresh factory (and a different cache size) gives the same tokens
    assert TokenBlocks(1000, cache_blocks=1).request_tokens(req([1, 2, 3], 24)) == a


def test_partial_block_is_prefix_and_tail_unique():
    tb = TokenBlocks(50_000, low=100)
    full = tb.request_tokens(req([1, 2], 16))
    part = tb.request_tokens(req([1, 2], 11))
    assert part == full[:11]
    # unhashed tail (kv-cache-tester): unique per request id, deterministic
    t1 = tb.request_tokens(req([1], 12, rid="x"))
    t2 = tb.request_tokens(req([1], 12, rid="y"))
    assert t1[:8] == t2[:8] == full[:8] and t1[8:] != t2[8:]
    assert tb.request_tokens(req([1], 12, rid="x")) == t1
    assert min(full + t1) >= 100


def test_namespaces_and_block_size():
    tb = TokenBlocks(32000)
    assert tb.request_tokens(req([1], 8, ns="a")) != tb.request_tokens(req([1], 8, ns="b"))
    assert len(tb.request_tokens(req([1, 2, 3], 3 * 32, bs=32))) == 96
    assert tb.request_array(req([], 0)).size == 0


def test_prefix_tokens_win():
    tb = TokenBlocks(100)
    r = req([1], 4)
    r.prefix_tokens = [5, 6, 7, 8, 9]
    assert tb.request_tokens(r) == [5, 6, 7, 8]


def test_token_ideal_equals_block_ideal():
    trace = [req([1, 2, 3], 24, rid="0"), req([1, 2, 4], 20, rid="1"),
             req([1, 2, 3, 5], 32, rid="2"), req([7, 2, 3], 24, rid="3")]
    tb = TokenBlocks(32000)
    prompts = [tb.request_tokens(r) for r in trace]
    assert (ideal_hits_tokens(prompts, 8).hit_tokens.tolist()
            == ideal_hits(trace).hit_tokens.tolist() == [0, 16, 24, 0])


def test_stable_across_processes():
    code = ("from deepinfer.bench.tokens import TokenBlocks;"
            "from deepinfer.bench.traces import TraceRequest;"
            "r=TraceRequest(0.0,None,[3,1,4],16,40,1,namespace='p',request_id='q');"
            "print(TokenBlocks(50000).request_tokens(r))")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    r = TraceRequest(0.0, None, [3, 1, 4], 16, 40, 1, namespace="p", request_id="q")
    assert out == str(TokenBlocks(50000).request_tokens(r))
    assert len(chain_digests("p", [3, 1, 4])) == 3


def test_tokens_look_uniform():
    arr = TokenBlocks(16).request_array(req(list(range(200)), 1600))
    counts = np.bincount(arr, minlength=16)
    assert counts.min() > 50  # every id used, roughly 100 each


def test_engine_page_hashes_share_exactly_the_common_blocks():
    from deepinfer.kv.hashing import chain_hashes, root_hash

    tb = TokenBlocks(49152)
    a = tb.request_tokens(req([1, 2, 3], 24))
    b = tb.request_tokens(req([1, 2, 4], 24))
    root = root_hash("model")
    ha, hb = chain_hashes(a, 4, root), chain_hashes(b, 4, root)  # engine pages of 4 tokens
    assert ha[:4] == hb[:4] and all(x != y for x, y in zip(ha[4:], hb[4:]))
