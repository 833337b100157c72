"""KV bytes per token from the engine's own layouts (models built on the meta device)."""

import pytest
import torch

from deepinfer.kv.tiers.codecs import get_codec
from deepinfer.kv.pool import PagePool
from deepinfer.models.kv_size import kv_bytes_per_token, kv_layout, reference_configs, tables

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 16


@pytest.fixture(scope="module")
def refs():
    return reference_configs()


def fp8(n):  # bytes of n elements under the fp8 codec: 1 byte each + fp32 scale per 32
    return n + n // 32 * 4


def fp4(n):  # fp4 codec: half a byte each + e4m3 scale per 16 + one fp32 scale per page buffer
    return n // 2 + n // 16 + 4


def test_llama3_8b(refs):
    cfg = refs["Llama-3-8B (GQA)"]
    per_layer = 2 * 8 * 128  # k and v elements per token
    assert kv_bytes_per_token(cfg).per_token_full == 32 * per_layer * 2 == 131072
    assert kv_bytes_per_token(cfg, "fp8").per_token_full == 32 * 2 * fp8(PS * 8 * 128) / PS
    assert kv_bytes_per_token(cfg, "fp4").per_token_full == 32 * 2 * fp4(PS * 8 * 128) / PS
    shared = kv_bytes_per_token(cfg, share=2)
    assert shared.shared_by == "model" and shared.owning_layers == 16
    assert shared.per_token_full == 131072 / 2


def test_deepseek_v3_mla(refs):
    cfg = refs["DeepSeek-V3 (MLA)"]
    specs, _ = kv_layout(cfg)
    assert len(specs) == 61 and all(s.components == (("kv", (1, 576)),) for s in specs)
    assert kv_bytes_per_token(cfg).per_token_full == 61 * 576 * 2 == 70272
    assert kv_bytes_per_token(cfg, "fp8").per_token_full == 61 * fp8(PS * 576) / PS


def test_gemma3_hybrid(refs):
    cfg = refs["Gemma-3-27B (5 local : 1 global)"]
    k = kv_bytes_per_token(cfg)
    assert (k.full_layers, k.sliding_layers, k.window) == (10, 52, 1024)
    per_layer = 2 * 16 * 128 * 2
    assert k.per_token_full == 10 * per_layer
    assert k.window_bytes_per_seq == 52 * per_layer * 1024
    assert k.per_token_all == 62 * per_layer
    small = kv_bytes_per_token(refs["Gemma-3-270M (5 local : 1 global)"])
    assert (small.full_layers, small.sliding_layers, small.per_token_full) == (3, 15, 3 * 1024)


def test_matches_pool_accounting(refs):
    """Lossless bytes/token x page size == what the pool allocates per page for that layout."""
    for name, cfg in refs.items():
        specs, _ = kv_layout(cfg, 2)
        k = kv_bytes_per_token(cfg, dtype=torch.float32, share=2)
        assert k.per_token_all * PS == PagePool.bytes_per_page(specs, PS, torch.float32), name


def test_codec_formula_matches_codec():
    assert get_codec("fp8").encoded_nbytes((PS, 8, 128), torch.bfloat16) == fp8(PS * 8 * 128)
    assert get_codec("fp4").encoded_nbytes((PS, 8, 128), torch.bfloat16) == fp4(PS * 8 * 128)


def test_table_renders():
    text = tables()
    assert "DeepSeek-V3 (MLA)" in text and "131,072" in text and "70,272" in text


def test_deepseek_v4_flash_layout():
    """V4-Flash: 2 window-only, 21 CSA (r=4), 20 HCA (r=128) layers. Pages hold one entry row per
    r tokens (HCA: one row per 16-token page, as a row cannot span pages), rings hold the window
    K=V vector plus the compressor (and indexer) inputs for 128 tokens."""
    from deepinfer.models.kv_size import v4_reference_configs, v4_sizes

    cfg = v4_reference_configs()["DeepSeek-V4-Flash"]
    specs, _ = kv_layout(cfg)
    assert len(specs) == 43 + 41
    assert [s.tokens_per_entry for s in specs[43:46]] == [4, 128, 4]
    k = v4_sizes(cfg, page_size=PS)
    assert k["layers"] == {"compressed_sparse_attention": 21, "heavily_compressed_attention": 20,
                           "sliding_attention": 2}
    assert k["compressed_sparse_attention"] == 21 * (512 + 128) * 2 / 4
    assert k["heavily_compressed_attention"] == 20 * 512 * 2 / PS
    assert v4_sizes(cfg, page_size=128)["heavily_compressed_attention"] == 20 * 512 * 2 / 128
    ring_elements = 2 * 512 + 21 * (512 + 4 * 512 + 4 * 128) + 20 * (512 + 2 * 512)
    assert k["ring_per_seq"] == ring_elements * 2 * 128
    pool = PagePool(specs[43:], 2, PS, torch.bfloat16, torch.device("meta"))
    assert pool.bytes_per_page(specs[43:], PS, torch.bfloat16) == k["paged_per_token"] * PS


def test_deepseek_v41_flash_only_kv_sources_own_pages():
    """V4.1-Flash (CSA2): 38 compressed layers but only the 4 KV sources (layers 2, 8, 14 at
    ratio 2, layer 20 at ratio 1) own entry pages; the others share them, adding no bytes."""
    from deepinfer.models.kv_size import v4_reference_configs, v4_sizes

    cfg = v4_reference_configs()["DeepSeek-V4.1-Flash"]
    specs, _ = kv_layout(cfg)
    entries = specs[40:]
    assert len(entries) == 38 and [i for i, s in enumerate(entries) if s.owns_cache] == [0, 6, 12, 18]
    assert {s.share_with for s in entries[1:6]} == {40} and {s.share_with for s in entries[19:]} == {58}
    k = v4_sizes(cfg, page_size=PS)
    assert (k["window_only"], k["compressed"], k["owning"]) == (2, 38, 4)
    assert k["by_ratio"] == {1: (512 + 128) * 2, 2: 3 * (512 + 128) * 2 / 2}
    assert k["ring_per_seq"] == (40 * 512 + 3 * 2 * 512) * 2 * 128
    assert PagePool.bytes_per_page(entries, PS, torch.bfloat16) == k["paged_per_token"] * PS
