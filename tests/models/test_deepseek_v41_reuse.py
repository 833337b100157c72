"""Prefix reuse on DeepSeek-V4.1 (CSA2) through the engine: only FULL layers own entry pages, the
REUSE / REINDEX layers read them, and a hit (ring snapshot + the FULL layers' pages, from memory or
from disk after a restart) gives the same greedy tokens and logits as no cache."""

import pytest
import torch

from reuse_checks import check_logits_after_a_hit, restart_hits_disk, save_tiny
from test_deepseek_v41 import tiny_v41
from test_window_reuse import GREEDY, check_accounting, ids, make

pytestmark = pytest.mark.usefixtures("one_thread")

# 5 layers (engine runs are the cost here): window, FULL / REUSE / REINDEX at r=2, FULL at r=1
SMALL = dict(compress_ratios=[0, 2, 2, 2, 1], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 3, 4])


@pytest.fixture(scope="module")
def v41_path(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_v41"), lambda vocab: tiny_v41(vocab_size=vocab, **SMALL))


def test_only_full_layers_own_entry_pages(v41_path):
    """Pages of 16 tokens: FULL layers 1 (r=2) and 4 (r=1) hold 8 and 16 rows of entry +
    indexer key; the two layers reading layer 1's entries and the window layer add no bytes."""
    runner = make(v41_path, page_size=16).engine.runner
    owned = [(spec.tokens_per_entry, {buf.shape[1] for buf in layer.values()})
             for spec, layer in zip(runner.pool.specs, runner.pool.buffers) if layer and spec.owns_cache]
    assert owned == [(2, {8}), (1, {16})]
    shared = [spec.share_with for spec in runner.pool.specs if spec.share_with is not None]
    assert shared == [5, 5]  # specs 5-8: entries of layers 1-4; layers 2 and 3 read layer 1's
    hd, ihd = 32, 16
    assert runner.pool.bytes_per_page(runner.pool.specs, 16, torch.float32) == 4 * (8 + 16) * (hd + ihd)


def test_shared_prefix_greedy_equal_no_cache(v41_path):
    """A hit restores the ring from its snapshot (or replays from 0) and the FULL layers' entry
    pages, which the REUSE / REINDEX layers then read: same greedy tokens as no cache."""
    shared = ids(40, 1)
    prompts = [shared + ids(13, 2), shared + ids(9, 3)]
    ref = [o.token_ids for o in make(v41_path, enable_prefix_cache=False).generate(prompts, GREEDY)]
    for mode, (cached, replayed) in {"snapshot": (40, 0), "replay": (0, 40)}.items():
        llm = make(v41_path, window_reuse=mode)
        outs = [llm.generate(p, GREEDY)[0] for p in prompts]
        assert [o.token_ids for o in outs] == ref, mode
        check_accounting(outs[1])
        assert (outs[1].num_cached_tokens, outs[1].num_replayed_tokens) == (cached, replayed), mode


def test_logits_after_a_hit_equal_no_cache(v41_path):
    check_logits_after_a_hit(v41_path)  # the hit: 40 tokens, from the snapshot at 40


def test_restarted_engine_hits_disk_pages_and_snapshots(v41_path, tmp_path):
    second = restart_hits_disk(v41_path, tmp_path)
    assert second.engine.shutdown()
