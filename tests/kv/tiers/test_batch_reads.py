"""BatchReads: a chunk of L3 page files read and checked natively, straight into pool pages."""

from __future__ import annotations

import os
import time

import pytest
import torch

from deepinfer.kv.layout import KVSpec
from deepinfer.kv.pool import PagePool
from deepinfer.kv.tiers.batch_reads import BatchReads
from deepinfer.kv.tiers.disk_file import page_id
from deepinfer.kv.tiers.disk_store import DiskStore
from deepinfer.kv.tiers.page_bytes import PoolTransfer
from deepinfer.kv.tiers.tier_io import TierIO

PS, N = 4, 12
SPECS = [KVSpec.gqa(2, 16), KVSpec.gqa(2, 16, share_with=0), KVSpec((("kv", (1, 48)),))]


def written(tmp_path, tokens: bool = True):
    """N lossless page files of a random pool -> (source pool, store, keys, ids, reader)."""
    src = PagePool(SPECS, N + 1, PS, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for b in src.owned_buffers():
        b.copy_(torch.randn(b.shape, generator=g))
    t = TierIO(PoolTransfer(src), PS, "model-x", disk_dir=tmp_path, disk_bytes=1 << 24)
    keys = [f"{i:032x}" for i in range(N)]
    ids = [page_id(i.to_bytes(16, "little"), list(range(i, i + PS)) if tokens else None) for i in range(N)]
    assert t.device_to_disk(list(range(1, N + 1)), keys, ids) and t.close()
    store = DiskStore(tmp_path, 1 << 24, t.namespace)
    reads = BatchReads.make(store, PS, t.disk_page_nbytes)
    if reads is None:
        pytest.skip("the native page reads did not build here")
    return src, store, keys, ids, reads


def into(reads, keys, ids):
    """Read into a fresh pool's pages 1..len(keys) -> (pool, pages in place)."""
    dst = PagePool(SPECS, N + 1, PS, torch.float32, torch.device("cpu"))
    tr = PoolTransfer(dst)
    n = reads.read(keys, ids, tr.host_buffers(), list(range(1, len(keys) + 1)),
                   lambda i: tr.page_views(i + 1))
    return dst, n


def same_pages(a, b, n):
    for x, y in zip(a.owned_buffers(), b.owned_buffers()):
        assert torch.equal(x[1 : n + 1], y[1 : n + 1])


def test_a_batch_lands_the_very_bytes_natively_and_counts_its_hits(tmp_path):
    src, store, keys, ids, reads = written(tmp_path)
    store.read_into = None  # the per-page path is not taken: every page is the native call's
    dst, n = into(reads, keys, ids)
    assert n == N
    same_pages(src, dst, N)
    s = store.stats()
    assert s["hits"] == N and s["misses"] == 0 and s["bytes_read"] == N * reads.payload_len


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "tag bit", "truncated", "missing",
                                    "another page"])
def test_a_bad_page_ends_the_batch_as_a_counted_miss(tmp_path, damage):
    src, store, keys, ids, reads = written(tmp_path)
    bad = 5
    f = tmp_path / keys[bad][:2] / f"{keys[bad]}.kv"
    data = bytearray(f.read_bytes())
    if damage == "missing":
        f.unlink()
    elif damage == "another page":
        ids[bad] = ids[bad + 1]
    elif damage == "truncated":
        f.write_bytes(bytes(data[:-1]))
    else:
        data[{"payload bit": len(data) // 2, "header bit": 40, "tag bit": len(data) - 1}[damage]] ^= 4
        f.write_bytes(bytes(data))
    dst, n = into(reads, keys, ids)
    assert n == bad
    same_pages(src, dst, bad)
    s = store.stats()
    assert s["hits"] == bad and s["misses"] == 1
    counter = {"payload bit": "checksum_failures", "header bit": "checksum_failures",
               "tag bit": "checksum_failures", "truncated": "corrupt_files",
               "another page": "mismatched_files"}.get(damage)
    if counter:
        assert s[counter] == 1 and not f.exists()  # quarantined: the page is written again


def test_pages_whose_header_it_cannot_predict_take_the_precise_path(tmp_path):
    src, store, keys, ids, reads = written(tmp_path, tokens=False)
    # token digests asked for, none in the files (accepted by the binding rules), and an
    # unchecked page: neither header is the one the native call expects
    ids = [page_id(p.page_hash, list(range(PS))) for p in ids]
    ids[7] = None
    dst, n = into(reads, keys, ids)
    assert n == N
    same_pages(src, dst, N)
    assert store.stats()["hits"] == N


@pytest.mark.parametrize("damage", ["header bit", "missing"])
def test_layer_reads_keep_the_files_before_the_first_bad_header(tmp_path, damage):
    src, store, keys, ids, reads = written(tmp_path)
    bad = 5
    f = tmp_path / keys[bad][:2] / f"{keys[bad]}.kv"
    if damage == "missing":
        f.unlink()
    else:
        data = bytearray(f.read_bytes())
        data[40] ^= 4
        f.write_bytes(bytes(data))
    dst = PagePool(SPECS, N + 1, PS, torch.float32, torch.device("cpu"))
    bufs = PoolTransfer(dst).host_buffers()
    layers, _ = reads.open_layers(keys, ids, bufs[0][0].nbytes)
    assert layers.opened() == bad
    pages, off = torch.arange(1, N + 1), 0
    for b in bufs:  # one piece per buffer, as a layer-wise stream reads them
        assert layers.read([b], pages, off) == bad
        off += b[0].nbytes
    assert layers.finish(False) == bad
    same_pages(src, dst, bad)


def test_a_hit_renews_the_recency_of_files_not_touched_this_minute(tmp_path):
    """mtime is the LRU order a restarted store reads back: a hit sets it, unless it is already
    recent (a hot file is not rewritten on every load)."""
    src, store, keys, ids, reads = written(tmp_path)
    old, recent = time.time() - 3600, time.time() - 20
    files = [tmp_path / k[:2] / f"{k}.kv" for k in keys]
    for i, f in enumerate(files):
        os.utime(f, (old, old) if i % 2 else (recent, recent))
    dst, n = into(reads, keys, ids)
    assert n == N
    for i, f in enumerate(files):
        if i % 2:
            assert f.stat().st_mtime > time.time() - 30  # renewed
        else:
            assert f.stat().st_mtime == pytest.approx(recent)  # already recent: left as it was
