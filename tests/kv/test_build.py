"""kv/build.py: pool sizing from the memory budget (the window pool takes its share first), the
per-layer buffers, and which cache manager and tier backend a config gets."""

import torch

from deepinfer.config import EngineConfig
from deepinfer.kv.build import build_cache_manager, build_device_kv, build_tiers
from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.layout import KVSpec
from deepinfer.kv.window.manager import WindowKVCacheManager

GQA = KVSpec.gqa(2, 16)  # k and v of 2 x 16: 64 elements per token, 1024 bytes per fp32 page of 4
SLIDING = KVSpec.gqa(2, 16, window=8)
CPU, F32 = torch.device("cpu"), torch.float32


def config(**kw):
    base = dict(page_size=4, kv_cache_memory_gb=2**-10, max_num_seqs=2, max_num_batched_tokens=64,
                device="cpu", dtype="float32", progress=False)
    return EngineConfig(**{**base, **kw})


def test_window_pool_takes_its_rings_out_of_the_budget():
    kv = build_device_kv(config(), [SLIDING, GQA], 256, F32, CPU)
    assert kv.window is not None and kv.window_chunk_tokens == 8  # the window, in whole pages
    ring = kv.window.rings.size
    assert ring == -(-(8 - 1 + 8) // 4) + 1 == 5
    assert kv.window.rings.num_pages == 2 * ring + 1  # a ring per sequence slot, plus padding
    assert kv.pool.allocator.num_pages == (2**20 - 2 * ring * 1024) // 1024  # the rest: layer 1
    buffers = kv.layer_buffers(2)
    assert buffers[0] is kv.window.buffers[0] and buffers[1] is kv.pool.buffers[1]
    assert kv.pool.specs[0].components == () and kv.pool.specs[1] == GQA


def test_without_rings_every_layer_is_paged():
    kv = build_device_kv(config(window_ring=False), [SLIDING, GQA], 256, F32, CPU)
    assert kv.window is None and kv.window_chunk_tokens is None
    assert kv.pool.allocator.num_pages == 2**20 // 2048
    kv = build_device_kv(config(num_pages=40), [GQA, GQA], 256, F32, CPU)
    assert kv.pool.allocator.num_pages == 40


def test_cache_manager_per_model():
    c = config(host_cache_gb=0, enable_disk_cache=False)
    windowed = build_cache_manager(c, build_device_kv(c, [SLIDING, GQA], 256, F32, CPU), "m", None)
    assert isinstance(windowed, WindowKVCacheManager) and windowed.max_chunk_tokens == 8
    assert windowed.window_stats()["window_ring_pages_total"] == 10
    plain = build_cache_manager(c, build_device_kv(c, [GQA], 256, F32, CPU), "m", None)
    assert type(plain) is KVCacheManager and plain.max_chunk_tokens is None
    assert plain.window_stats() == {}


def test_tiers_only_when_a_lower_tier_and_the_prefix_cache_are_on(tmp_path):
    pool = build_device_kv(config(), [GQA], 256, F32, CPU).pool
    assert build_tiers(config(host_cache_gb=0, enable_disk_cache=False), pool, "m") is None
    assert build_tiers(config(enable_prefix_cache=False), pool, "m") is None
    io = build_tiers(config(host_cache_gb=2**-10, enable_disk_cache=True, disk_cache_dir=str(tmp_path),
                            disk_cache_gb=2**-10), pool, "m")
    try:
        assert io is not None and io.host_capacity == 2**20 // 1024
        assert io.store is not None and io.disk_capacity == 2**20 // io.store.file_bytes(1024)
    finally:
        io.close()
