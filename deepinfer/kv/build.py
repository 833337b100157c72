"""The one place that sizes the KV pools and wires the cache: the device pools (page pool and
window pool) for the model runner, the lower tiers and the cache manager for the engine.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig
from .cache_manager import KVCacheManager
from .layout import KVSpec
from .pool import PagePool
from .tiers.page_bytes import PoolTransfer
from .tiers.policy import TierPolicy
from .tiers.tier_io import TierIO
from .window.layout import WindowLayout, cdiv
from .window.manager import WindowKVCacheManager, WindowReuse
from .window.pool import WindowPool

log = logging.getLogger(__name__)


@dataclass
class DeviceKV:
    """The KV buffers on the device: the page pool, and the window pool of a model with a
    window group (sliding-window layers keep their KV in per-sequence rings there)."""

    pool: PagePool
    window: WindowPool | None = None
    window_chunk_tokens: int | None = None  # largest prefill chunk of one sequence (ring size)

    def layer_buffers(self, num_layers: int) -> list[dict[str, torch.Tensor]]:
        """Per layer: the buffers it stores into and attends over."""
        w = self.window
        return [w.buffers[i] if w is not None and i in w.buffers else self.pool.buffers[i]
                for i in range(num_layers)]


def build_device_kv(config: EngineConfig, specs: Sequence[KVSpec], max_model_len: int,
                    dtype: torch.dtype, device: torch.device) -> DeviceKV:
    """Size and allocate the pools: ``config.num_pages`` pages, else ``kv_cache_memory_gb``
    (the window pool takes its share first); the page pool then holds only the full group."""
    ps = config.page_size
    budget = None if config.num_pages else config.kv_cache_memory_gb * 2**30
    layout = WindowLayout.from_specs(specs) if config.window_ring else None
    window: WindowPool | None = None
    chunk: int | None = None
    page_specs = list(specs)
    if layout is not None:
        page_specs = layout.page_specs(specs)
        chunk = layout.chunk_tokens(ps, config.max_num_batched_tokens, config.window_chunk_tokens)
        ring = layout.ring_pages(ps, chunk)
        wbytes = WindowPool.bytes_per_page(specs, layout, ps, dtype)
        wpages = window_pool_pages(layout, ring, wbytes, config.max_num_seqs, budget)
        window = WindowPool(specs, layout, wpages, ring, ps, dtype, device)
        if budget is not None:
            budget -= (wpages - 1) * wbytes
    per_page = PagePool.bytes_per_page(page_specs, ps, dtype)
    if config.num_pages:
        num_pages = config.num_pages
    elif per_page:
        assert budget is not None
        num_pages = max(2, int(budget // per_page))
    else:  # only window layers: pages hold no bytes, their ids still index the prefix cache
        num_pages = 2 * config.max_num_seqs * cdiv(max_model_len, ps) + 1
    return DeviceKV(PagePool(page_specs, num_pages, ps, dtype, device), window, chunk)


def window_pool_pages(layout: WindowLayout, ring_pages: int, page_bytes: int, max_num_seqs: int,
                      budget_bytes: float | None) -> int:
    """Window-pool size: a full ring for every sequence slot, but (when the pool is sized by
    memory) at most half the KV budget; never less than one ring. Page 0 is padding."""
    pages = max_num_seqs * ring_pages
    if budget_bytes is not None and page_bytes:
        pages = min(pages, max(ring_pages, int(budget_bytes / 2 // page_bytes)))
    return pages + 1


def build_tiers(config: EngineConfig, pool: PagePool, model_identity: str) -> TierIO | None:
    """L2/L3 backend per the config (None when both are off or prefix caching is). A tier asked
    for that ends up with no usable capacity is logged at start-up, naming its flag."""
    c = config
    if not c.enable_prefix_cache or not pool.owned_buffers():
        return None  # (no buffers: a model of sliding-window layers only, whose pages hold nothing)
    disk_dir = c.disk_cache_path()
    sizes = bounded_sizes(c.host_cache_gb, disk_dir, c.disk_cache_gb)
    tiers = None
    # with a networked store, disk_cache_gb also bounds what the tree indexes there
    l3_bytes = sizes.disk_bytes or (int(c.disk_cache_gb * 2**30) if c.kv_store else 0)
    if sizes.host_bytes > 0 or l3_bytes > 0:
        secret = c.kv_store_secret.encode() if c.kv_store_secret else None
        tiers = TierIO(PoolTransfer(pool), c.page_size, model_identity,
                       host_bytes=sizes.host_bytes, host_codec=c.kv_codec_host,
                       disk_dir=disk_dir if sizes.disk_bytes > 0 else None,
                       disk_bytes=l3_bytes, disk_codec=c.kv_codec_disk, disk_secret=secret,
                       kv_store=c.kv_store, kv_store_options=c.kv_store_options)
    if c.host_cache_gb > 0 and (tiers is None or tiers.host_capacity == 0):
        log.warning("L2 (host) KV tier has no usable capacity: --host-cache-gb %g is bounded to "
                    "%d bytes by the available memory, less than one page; L2 is off",
                    c.host_cache_gb, sizes.host_bytes)
    if disk_dir and c.disk_cache_gb > 0:
        if tiers is None or tiers.disk_capacity == 0:
            log.warning("L3 (disk) KV tier at %s has no usable capacity: --disk-cache-gb %g is "
                        "bounded to %d bytes (files there plus half the free space), less than "
                        "one page; L3 is off", disk_dir, c.disk_cache_gb, sizes.disk_bytes)
        elif sizes.disk_bytes < int(c.disk_cache_gb * 2**30):
            log.warning("L3 (disk) KV tier at %s: --disk-cache-gb %g bounded to %.3f GiB (files "
                        "there plus half the free space)", disk_dir, c.disk_cache_gb,
                        sizes.disk_bytes / 2**30)
    return tiers


def build_cache_manager(config: EngineConfig, device_kv: DeviceKV, model_identity: str,
                        tiers: TierIO | None) -> KVCacheManager:
    """``KVCacheManager``, or ``WindowKVCacheManager`` with the window settings for a model
    with a window group."""
    c = config
    args = (device_kv.pool.allocator, c.page_size, model_identity, c.enable_prefix_cache,
            c.max_node_pages)
    policy = TierPolicy(c.cache_policy, c.selective_hits, int(c.kv_idle_promote_mb * 2**20))
    window = device_kv.window
    if window is None:
        stream = c.kv_stream_layers and not c.overlap_schedule
        return KVCacheManager(*args, tiers=tiers, policy=policy, max_loads=2 * c.max_num_seqs,
                              stream_layers=stream)
    layout = window.layout
    interval = layout.window if c.window_snapshot_interval is None else c.window_snapshot_interval
    interval = cdiv(interval, c.page_size) * c.page_size if interval else 0
    assert device_kv.window_chunk_tokens is not None
    reuse = WindowReuse(layout=layout, rings=window.rings, io=window, mode=c.window_reuse,
                        replay_tokens=c.window_replay_tokens, snapshot_interval=interval,
                        snapshot_bytes=int(c.window_snapshot_gb * 2**30),
                        chunk_tokens=device_kv.window_chunk_tokens)
    return WindowKVCacheManager(*args, tiers=tiers, policy=policy, max_loads=2 * c.max_num_seqs,
                                window=reuse)


# ------------------------------------------------------------------------------ tier sizes


def available_memory() -> int | None:
    """Bytes of RAM available to new allocations (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class TierSizes:
    host_bytes: int
    disk_bytes: int


def bounded_sizes(host_gb: float, disk_dir: str | None, disk_gb: float) -> TierSizes:
    """Requested sizes, bounded: L2 by half the available RAM, L3 by what the disk can take
    (its files already there plus half the free space)."""
    host = int(host_gb * 2**30)
    avail = available_memory()
    if avail is not None:
        host = min(host, avail // 2)
    disk = int(disk_gb * 2**30) if disk_dir else 0
    if disk_dir and disk:
        probe = Path(disk_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
            used = sum(f.stat().st_size for f in Path(disk_dir).glob("??/*.kv")) if Path(disk_dir).is_dir() else 0
            disk = min(disk, used + free // 2)
        except OSError:
            pass
    return TierSizes(max(0, host), max(0, disk))
