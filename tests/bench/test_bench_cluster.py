"""Cluster planner: replicas with local tiers and a shared pool, per routing policy, with exact
hit counts on small traces and the bounds (single engine, ideal) on a real one."""

from __future__ import annotations

import pytest

from deepinfer.bench.cluster import compare, simulate
from deepinfer.bench.traces import TraceRequest, default_traces_dir, load_trace

B = 16  # block and page size


def conversation() -> list[TraceRequest]:
    """Session a: two turns (the second extends the first by a block), then session b."""
    return [TraceRequest(0.0, "a", [1, 2], B, 2 * B, 1, request_id="a0"),
            TraceRequest(1.0, "a", [1, 2, 3], B, 3 * B, 1, request_id="a1"),
            TraceRequest(2.0, "b", [7, 8], B, 2 * B, 1, request_id="b0")]


def run(policy, pool_tokens=0, **kw):
    args = dict(replicas=2, page_size=B, l1_tokens=64 * B, concurrency=1)
    args.update(kw)
    return simulate(conversation(), policy=policy, pool_tokens=pool_tokens, **args)


def test_round_robin_splits_a_conversation_and_only_the_pool_gets_it_back():
    local = run("round_robin")
    assert local.routed == [2, 1] and local.hit_tokens == 0
    shared = run("round_robin", pool_tokens=64 * B)
    assert shared.hit_tokens == 2 * B and shared.hit_tokens_by_tier == {"disk": 2 * B}


def test_kv_routing_sends_the_next_turn_to_the_replica_holding_its_prefix():
    r = run("kv")
    assert r.hit_tokens == 2 * B and r.hit_tokens_by_tier == {"device": 2 * B}
    assert r.routed == [2, 1]  # a1 follows a0 to replica 0; b0 goes to the idle one


def test_least_load_balances_prompt_tokens():
    r = run("least_load", concurrency=2)
    # a0 -> 0; a1 -> 1 (0 tokens there against a0's 32); b0 -> 0 (32 against a1's 48)
    assert r.routed == [2, 1] and r.hit_tokens == 0


def test_a_page_the_pool_evicted_is_a_miss():
    a0, a1, b0 = conversation()
    trace = [a0, b0, a1]  # b0's pages come between the turns of a
    big = simulate(trace, policy="round_robin", replicas=3, page_size=B, l1_tokens=64 * B,
                   pool_tokens=4 * B)
    assert big.hit_tokens == 2 * B  # (a1's own last page then evicts one)
    small = simulate(trace, policy="round_robin", replicas=3, page_size=B, l1_tokens=64 * B,
                     pool_tokens=2 * B)  # b0's two pages push a0's out
    assert small.hit_tokens == 0 and small.pool_evicted_pages == 2


def test_bad_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="policy must be one of"):
        run("random")


@pytest.mark.skipif(default_traces_dir() is None, reason="no traces folder")
def test_on_a_real_trace_the_pool_lies_between_local_caches_and_the_ideal():
    trace = load_trace(default_traces_dir() / "mooncake_conversation_trace.jsonl",
                       max_requests=300, token_scale=0.125)
    out = compare(trace, replicas=4, page_size=64, l1_tokens=100_000, pool_tokens=10_000_000,
                  concurrency=2)
    for row in out["rows"]:
        assert row["local"] < row["shared"] <= out["ideal"] + 1e-9
    # a pool big enough for the whole trace, shared by all: the same hits whatever the
    # routing, the ideal's but for what pages (64 tokens) round off prefixes
    assert len({row["shared"] for row in out["rows"]}) == 1
    assert out["rows"][0]["shared"] >= 0.99 * out["ideal"]
    assert out["single_all_memory"] <= out["ideal"]
