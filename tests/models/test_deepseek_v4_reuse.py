"""Prefix reuse on DeepSeek-V4 through the engine: a hit restores every layer's state (window ring
with the compressor inputs from a snapshot; compressed entries and indexer keys from the cached
pages), so greedy tokens and logits equal the no-cache ones; replayed tokens are reported apart."""

import pytest
import torch

from reuse_checks import check_logits_after_a_hit, restart_hits_disk, save_tiny
from test_deepseek_v4 import tiny_v4
from test_window_reuse import GREEDY, PS, check_accounting, ids, make

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_v4"), lambda vocab: tiny_v4(vocab_size=vocab))


def test_shared_prefix_greedy_equal_no_cache(v4_path):
    shared = ids(40, 1)
    prompts = [shared + ids(13, 2), shared + ids(9, 3), shared + ids(17, 4)]
    ref = [o.token_ids for o in make(v4_path, enable_prefix_cache=False).generate(prompts, GREEDY)]
    paged = make(v4_path, window_ring=False)  # every token of every spec paged
    assert [paged.generate(p, GREEDY)[0].token_ids for p in prompts] == ref
    # snapshot: one every 8 tokens (the ring window), so one at 40; a replay of a V4 ring is only
    # exact from position 0 (entries pooled from an empty ring would be wrong), so it replays all
    for mode, (cached, replayed) in {"snapshot": (40, 0), "replay": (0, 40), "off": (0, 40)}.items():
        llm = make(v4_path, window_reuse=mode)
        first = llm.generate(prompts[0], GREEDY)[0]
        rest = llm.generate(prompts[1:], GREEDY)
        assert [first.token_ids] + [o.token_ids for o in rest] == ref, mode
        for o in rest:
            check_accounting(o)
            assert (o.num_cached_tokens, o.num_replayed_tokens) == (cached, replayed), mode


@pytest.mark.parametrize("kw", [dict(), dict(window_snapshot_interval=0), dict(window_reuse="replay")],
                         ids=["snapshot", "no-snapshot-at-hit", "replay"])
def test_logits_after_a_hit_equal_no_cache(v4_path, kw):
    """The hit ends inside CSA and HCA windows; without a snapshot there, the hit is replayed
    from 0 (a replay from a boundary would pool entries from an empty ring: off by ~1e-3)."""
    check_logits_after_a_hit(v4_path, **kw)


def test_compressed_entries_are_packed_per_page(v4_path):
    """With pages of 16 tokens the pool holds ceil(16 / r) entry rows per page: 4 for CSA (r=4),
    2 for HCA (r=8); the window layers hold nothing in pages (their state is in the rings)."""
    runner = make(v4_path, page_size=16).engine.runner
    rows = [(spec.tokens_per_entry, {buf.shape[1] for buf in layer.values()})
            for spec, layer in zip(runner.pool.specs, runner.pool.buffers) if layer]
    assert rows == [(4, {4}), (8, {2}), (4, {4})]
    hd, ihd = 32, 16  # head_dim, index_head_dim: CSA rows hold entry + indexer key
    assert runner.pool.bytes_per_page(runner.pool.specs, 16, torch.float32) == 4 * (4 * (hd + ihd) * 2 + 2 * hd)


def test_multi_turn_chat_hits_turn_end_snapshots(v4_path):
    llm, nocache = make(v4_path), make(v4_path, enable_prefix_cache=False)
    conv = []
    for turn in range(4):
        prompt = conv + ids(7 + 3 * turn, 20 + turn)
        o = llm.generate(prompt, GREEDY)[0]
        assert o.token_ids == nocache.generate(prompt, GREEDY)[0].token_ids
        check_accounting(o)
        if turn:  # the previous turn's last full page, restored from its turn-end snapshot
            assert o.num_cached_tokens == (len(conv) - 1) // PS * PS and o.num_replayed_tokens == 0
        conv = prompt + o.token_ids


def test_restarted_engine_hits_disk_pages_and_snapshots(v4_path, tmp_path):
    """L3 holds the packed entry pages and the ring snapshots: a restarted engine sharing the
    directory restores both (no replay) and decodes the same tokens as no cache."""
    second = restart_hits_disk(v4_path, tmp_path)
    assert second.engine.stats()["window_snapshot_disk_hits"] == 1
    assert second.engine.shutdown()
