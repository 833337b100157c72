"""Idle-time L3 -> L2 promotion of recent conversations (kv/tiers/promotion.py), on a real
engine: a next turn whose history went down to L3 loads it from L2, exactly; a damaged file is
never promoted; the budget bounds each idle period; off by default."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.hashing import chain_hashes
from deepinfer.kv.pool import PageAllocator
from deepinfer.kv.radix import DEVICE, DISK, HOST, RadixTree
from deepinfer.kv.tiers.backend import CountingBackend
from deepinfer.kv.tiers.policy import WRITE_THROUGH, TierPolicy
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # a turn's KV: its prompt
PS = 4
PAGE_BYTES = PS * 2 * 2 * 2 * 16 * 4  # tiny Llama: 2 layers x K,V x 2 heads x 16, fp32


def make(tiny_llama, disk, **kw):
    args = dict(page_size=PS, num_pages=256, max_num_batched_tokens=128, progress=False,
                host_cache_gb=64 * PAGE_BYTES / 2**30, enable_disk_cache=True,
                disk_cache_dir=str(disk))
    args.update(kw)
    return LLM(str(tiny_llama), **args)


def ids(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def to_l3_only(m: LLM) -> None:
    """Push everything cached down to L3 (L1 -> L2, then L2 dropped: write-through has it)."""
    m.engine.kv.evict()
    m.engine.tiers.flush()
    m.engine.kv.evict(HOST)
    tree = m.engine.kv.tree
    assert tree.pages_in_tier[DEVICE] == tree.pages_in_tier[HOST] == 0 < tree.pages_in_tier[DISK]


def idle(m: LLM, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while m.engine.kv.on_idle():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def promotion(m: LLM) -> dict:
    return m.engine.kv.tier_stats()["idle_promotion"]


@pytest.fixture()
def turns():
    first = ids(40, 1)  # 10 pages
    return first, first + ids(12, 2)  # turn 2 = turn 1's prompt + a new message


def test_next_turn_loads_from_l2_after_idle_promotion_and_matches(tiny_llama, tmp_path, turns):
    first, second = turns
    ref = make(tiny_llama, tmp_path / "ref", enable_prefix_cache=False).generate(second, GREEDY)
    m = make(tiny_llama, tmp_path / "on", kv_idle_promote_mb=1.0)
    m.generate(first, ONE)
    to_l3_only(m)
    idle(m)
    st = promotion(m)
    assert st["promoted_pages"] == 10 and st["promotions_dropped"] == 0 and st["in_flight"] == 0
    assert m.engine.stats()["cache_idle_promoted_pages_total"] == 10
    assert m.engine.kv.tree.pages_in_tier[HOST] >= 10
    out = m.generate(second, GREEDY)[0]
    assert out.cached_tokens_by_tier["host"] == 40 and out.cached_tokens_by_tier["disk"] == 0
    assert out.token_ids == ref[0].token_ids
    # off (the default): the same turn loads from L3
    off = make(tiny_llama, tmp_path / "off")
    off.generate(first, ONE)
    to_l3_only(off)
    assert not off.engine.kv.on_idle()
    out = off.generate(second, GREEDY)[0]
    assert out.cached_tokens_by_tier["disk"] == 40 and out.cached_tokens_by_tier["host"] == 0
    assert out.token_ids == ref[0].token_ids


def test_a_damaged_file_is_not_promoted_and_its_slots_come_back(tiny_llama, tmp_path, turns):
    first, second = turns
    ref = make(tiny_llama, tmp_path / "ref", enable_prefix_cache=False).generate(second, GREEDY)
    m = make(tiny_llama, tmp_path / "l3", kv_idle_promote_mb=1.0, max_node_pages=4)
    m.generate(first, ONE)
    to_l3_only(m)
    kv = m.engine.kv
    path = kv.tree.match(chain_hashes(first, PS, kv.root(None)), touch=False, count_hit=False).path
    assert [n.num_pages for n in path] == [4, 4, 2]
    key = path[1].tiers[DISK][0]
    f = tmp_path / "l3" / key[:2] / f"{key}.kv"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    free_before = m.engine.tiers.host.num_free
    idle(m)
    st = promotion(m)
    assert st["promotions_dropped"] == 1 and st["promoted_pages"] == 6
    assert path[1].tiers[HOST] is None and path[0].tiers[HOST] and path[2].tiers[HOST]
    assert m.engine.tiers.host.num_free == free_before - 6
    out = m.generate(second, GREEDY)[0]
    assert out.token_ids == ref[0].token_ids
    assert out.cached_tokens_by_tier["host"] == 16 and out.cached_tokens_by_tier["disk"] == 0


def test_budget_bounds_each_idle_period(tiny_llama, tmp_path, turns):
    first, _ = turns
    m = make(tiny_llama, tmp_path, kv_idle_promote_mb=4 * PAGE_BYTES / 2**20, max_node_pages=2)
    m.generate(first, ONE)
    to_l3_only(m)
    idle(m)
    assert promotion(m)["promoted_pages"] == 4  # two nodes of 2 pages: the period's budget
    idle(m)
    assert promotion(m)["promoted_pages"] == 4  # still the same idle period
    m.engine.kv.poll()  # a step ran: a new period
    idle(m)
    assert promotion(m)["promoted_pages"] == 8 and promotion(m)["idle_periods"] == 2


def test_a_node_over_the_budget_does_not_block_smaller_ones(tiny_llama, tmp_path, turns):
    """10 pages in nodes of 8 and 2, a budget of 4: the 8-page node never fits, the 2-page one
    is promoted (the walk used to stop at the first node over the budget)."""
    first, _ = turns
    m = make(tiny_llama, tmp_path, kv_idle_promote_mb=4 * PAGE_BYTES / 2**20, max_node_pages=8)
    m.generate(first, ONE)
    to_l3_only(m)
    idle(m)
    assert promotion(m)["promoted_pages"] == 2 and promotion(m)["promotions"] == 1
    assert m.engine.kv.tree.pages_in_tier[HOST] == 2


def test_evict_older_than_keeps_younger_nodes():
    tree = RadixTree(page_size=1)
    a, _ = tree.insert([b"a"], None, HOST, [1])
    b, _ = tree.insert([b"b"], None, HOST, [2])
    released = []
    stamp_b = b.path[0].last_access
    assert tree.evict(HOST, 2, lambda n, t: released.append(n.hashes), older_than=stamp_b) == 1
    assert released == [[b"a"]] and tree.pages_in_tier[HOST] == 1
    assert tree.evict(HOST, 1, lambda n, t: released.append(n.hashes)) == 1


def test_promotion_takes_l2_copies_of_l1_pages_not_younger_l2_pages():
    """Steady-state multi-turn under LRU: a conversation is L3-only once L2 holds younger
    pages; the promotion leaves those alone and uses the L2 copies of pages L1 also holds."""
    backend = CountingBackend(host_pages=16, disk_pages=100)
    kv = KVCacheManager(PageAllocator(8 + 1), PS, "model", tiers=backend, max_node_pages=4,
                        policy=TierPolicy(WRITE_THROUGH, idle_promote_bytes=1 << 30))
    a, b, c = ([k * 1000 + i for i in range(32)] for k in (1, 2, 3))  # 8 pages each
    for toks in (a, b, c, a):  # the second A loads from L2 (B drops to L3, C goes to L2)
        req = Request(f"r{len(toks)}-{toks[0]}", list(toks), SamplingParams(max_tokens=1))
        kv.prefetch(req)
        kv.match_prefix(req)
        assert kv.allocate(req, len(toks) - req.num_computed_tokens)
        req.num_computed_tokens = len(toks)
        kv.cache_pages(req)
        kv.release(req)
    tiers = lambda toks: [n.best_tier() for n in kv.tree.match(  # noqa: E731
        chain_hashes(toks, PS, kv.root(None)), touch=False, count_hit=False).path]
    assert tiers(b) == [DISK, DISK] and tiers(c) == [HOST, HOST] and set(tiers(a)) == {DEVICE}
    c_slots = [n.tiers[HOST] for n in kv.tree.match(chain_hashes(c, PS, kv.root(None)),
                                                     touch=False, count_hit=False).path]
    while kv.on_idle():
        pass
    st = kv.tier_stats()["idle_promotion"]
    assert st["promoted_pages"] == 4  # a quarter of L2 per idle period
    assert tiers(b)[0] == HOST and set(tiers(a)) == {DEVICE}
    assert [n.tiers[HOST] for n in kv.tree.match(chain_hashes(c, PS, kv.root(None)),
                                                  touch=False, count_hit=False).path] == c_slots
    assert backend.moved["disk->host"] == 4
