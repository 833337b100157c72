"""Tier policy on the cache manager with the counting backend (no tensors): placement per policy,
load accounting, and invariants under random traffic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.pool import PageAllocator
from deepinfer.kv.radix import DEVICE, DISK, HOST, NUM_TIERS
from deepinfer.kv.tiers.backend import CountingBackend
from deepinfer.kv.tiers.policy import SELECTIVE, WRITE_BACK, WRITE_THROUGH, TierPolicy
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

PS = 4
_ids = itertools.count()


def manager(l1_pages, host=0, disk=0, mode=WRITE_BACK, hits=2):
    backend = CountingBackend(host_pages=host, disk_pages=disk)
    kv = KVCacheManager(PageAllocator(l1_pages + 1), PS, "model", tiers=backend,
                        policy=TierPolicy(mode, hits), max_node_pages=4)
    return kv, backend


def run(kv, tokens, keep=False):
    """One request as the scheduler and engine drive it: match, prefill, cache, finish
    (``keep``: leave it running, holding its pages and its lock on the tree)."""
    req = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=1))
    kv.prefetch(req)
    kv.match_prefix(req)
    n = len(tokens) - req.num_computed_tokens
    if not kv.allocate(req, n):
        kv.release(req)
        return None
    req.num_computed_tokens += n
    kv.cache_pages(req)
    if not keep:
        kv.release(req)
    return req


def seq(k, n=32):
    return [k * 1000 + i for i in range(n)]


def test_write_back_demotes_down_and_loads_back_by_tier():
    kv, be = manager(l1_pages=8, host=8, disk=100, mode=WRITE_BACK)
    run(kv, seq(1))  # 8 pages
    assert kv.tree.pages_in_tier[DISK] == 0
    run(kv, seq(2))  # evicts seq 1 from L1 into L2
    assert kv.tree.pages_in_tier[HOST] == 8 and be.moved["device->host"] == 8
    assert kv.tree.pages_in_tier[DISK] == 0  # write-back: nothing on disk yet
    run(kv, seq(3))  # seq 2 -> L2, which overflows: seq 1 -> L3
    assert kv.tree.pages_in_tier[DISK] == 8 and be.moved["host->disk"] == 8
    r = run(kv, seq(1))  # 7 pages usable (one token always computed): all from L3
    assert r.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 28}
    assert r.num_cached_tokens == 28
    r = run(kv, seq(3))  # seq 3 went to L2 when seq 1 came back
    assert r.cached_tokens_by_tier == {"device": 0, "host": 28, "disk": 0}
    assert kv.stats.hit_tokens_by_tier == {"device": 0, "host": 28, "disk": 28}


def test_write_through_writes_at_once_and_l2_eviction_only_drops():
    kv, be = manager(l1_pages=8, host=8, disk=100, mode=WRITE_THROUGH)
    run(kv, seq(1))
    assert kv.tree.pages_in_tier[DISK] == 8 and be.moved["device->disk"] == 8
    run(kv, seq(2))
    run(kv, seq(3))
    assert be.moved["host->disk"] == 0  # already there
    assert kv.tree.pages_in_tier[DISK] == 24


def test_selective_writes_only_hot_prefixes():
    kv, be = manager(l1_pages=64, host=8, disk=100, mode=SELECTIVE, hits=2)
    run(kv, seq(1))
    assert kv.tree.pages_in_tier[DISK] == 0
    run(kv, seq(1))  # first hit
    assert kv.tree.pages_in_tier[DISK] == 0
    run(kv, seq(1))  # second hit: written through
    assert kv.tree.pages_in_tier[DISK] == 7  # the hit part (the last page was never a hit)
    kv2, be2 = manager(l1_pages=8, host=8, disk=100, mode=SELECTIVE, hits=2)
    for k in range(1, 5):  # cold prefixes overflow L2 and are dropped, not written
        run(kv2, seq(k))
    assert kv2.tree.pages_in_tier[DISK] == 0 and be2.moved["host->disk"] == 0


def test_no_l2_evicts_straight_to_disk():
    kv, be = manager(l1_pages=8, host=0, disk=100, mode=WRITE_BACK)
    run(kv, seq(1))
    run(kv, seq(2))
    assert be.moved["device->disk"] == 8 and kv.tree.pages_in_tier[HOST] == 0
    assert run(kv, seq(1)).cached_tokens_by_tier["disk"] == 28


def test_bounded_tiers_drop_and_subtrees_go():
    kv, be = manager(l1_pages=8, host=4, disk=4, mode=WRITE_BACK)
    for k in range(1, 6):
        run(kv, seq(k))
    assert kv.tree.pages_in_tier[HOST] <= 4 and kv.tree.pages_in_tier[DISK] <= 4
    assert len(be._free_slots) + kv.tree.pages_in_tier[HOST] == 4


def test_failed_disk_write_forgets_the_record():
    class Failing(CountingBackend):
        def __init__(self):
            super().__init__(host_pages=0, disk_pages=100)
            self.failed = []

        def device_to_disk(self, pages, keys, ids):
            self.failed += keys
            return True

        def poll_failed_writes(self):
            out, self.failed = self.failed, []
            return out

    be = Failing()
    kv = KVCacheManager(PageAllocator(9), PS, "m", tiers=be, policy=TierPolicy(WRITE_THROUGH),
                        max_node_pages=4)
    run(kv, seq(1))
    assert kv.tree.pages_in_tier[DISK] == 8
    kv.poll()
    assert kv.tree.pages_in_tier[DISK] == 0 and kv.tree.pages_in_tier[DEVICE] == 8
    assert kv.tiers.stale_disk_records == 8


def _check(kv, be, host_cap, disk_cap, live_pages):
    tree = kv.tree
    assert tree.pages_in_tier[HOST] <= host_cap and tree.pages_in_tier[DISK] <= disk_cap
    assert len(be._free_slots) + tree.pages_in_tier[HOST] == host_cap
    counts = [0] * NUM_TIERS
    slots = []
    stack = [(tree.root, True)]
    while stack:
        n, parent_dev = stack.pop()
        if n is not tree.root:
            assert n.best_tier() is not None
            assert parent_dev or n.tiers[DEVICE] is None  # L1 is prefix-closed
            for t in range(NUM_TIERS):
                if n.tiers[t] is not None:
                    assert len(n.tiers[t]) == n.num_pages
                    counts[t] += n.num_pages
            slots += n.tiers[HOST] or []
        stack += [(c, n is tree.root or n.tiers[DEVICE] is not None) for c in n.children.values()]
    assert counts == tree.pages_in_tier
    assert len(slots) == len(set(slots))
    assert kv.allocator.num_free + tree.pages_in_tier[DEVICE] + live_pages == kv.allocator.num_pages - 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40), st.booleans()), min_size=1, max_size=25),
       st.sampled_from([WRITE_BACK, WRITE_THROUGH, SELECTIVE]), st.integers(0, 12), st.integers(0, 12))
def test_invariants_under_random_traffic(reqs, mode, host, disk):
    """Whatever the traffic (some requests left running, holding locks): tiers stay within
    capacity, no L1 page or L2 slot leaks or is shared, L1 stays prefix-closed, hits add up."""
    kv, be = manager(l1_pages=24, host=host, disk=disk, mode=mode, hits=1)
    live = []
    for prefix, length, keep in reqs:
        toks = [prefix * 100 + (i % 7) for i in range(length)]
        r = run(kv, toks, keep=keep and len(live) < 2)
        if r is not None:
            assert sum(r.cached_tokens_by_tier.values()) == r.num_cached_tokens <= len(toks) - 1
            if r.pages:
                live.append(r)
        _check(kv, be, host, disk, sum(len(x.pages) - x.num_tree_pages for x in live))
        if len(live) == 2 and keep:
            kv.release(live.pop(0))
    for r in live:
        kv.release(r)
    _check(kv, be, host, disk, 0)
    assert kv.tree.evictable_pages(DEVICE) == kv.tree.pages_in_tier[DEVICE]  # every lock released


@pytest.mark.parametrize("mode", ["nope", ""])
def test_bad_policy_rejected(mode):
    with pytest.raises(ValueError):
        TierPolicy(mode)
