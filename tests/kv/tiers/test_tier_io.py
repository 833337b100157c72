"""TierIO: pages between a real PagePool, L2 host slots and L3 files, through the codecs."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from deepinfer.kv.tiers.codecs import get_codec
from deepinfer.kv.layout import KVSpec
from deepinfer.kv.pool import PagePool
from deepinfer.kv.radix import DISK, HOST
from deepinfer.kv.tiers.backend import LoadJob
from deepinfer.kv.tiers.page_bytes import PoolTransfer, decode_pages, encode_pages, page_nbytes
from deepinfer.kv.tiers.disk_file import page_id
from deepinfer.kv.tiers.page_loader import PageLoader
from deepinfer.kv.tiers.tier_io import TierIO

PS = 4
SPECS = [KVSpec.gqa(2, 16), KVSpec.gqa(2, 16, share_with=0), KVSpec((("kv", (1, 48)),))]


def pool(seed=0):
    p = PagePool(SPECS, 16, PS, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for b in p.owned_buffers():
        b.copy_(torch.randn(b.shape, generator=g))
    return p


def io(p, tmp_path=None, **kw):
    args = dict(host_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=(1 << 24) if tmp_path else 0)
    args.update(kw)
    return TierIO(PoolTransfer(p), PS, "model-x", **args)


def ids(hashes):
    return [page_id(h) for h in hashes]


def wait_done(job, timeout=120):
    t0 = time.monotonic()
    while not job.done:
        assert time.monotonic() - t0 < timeout
        time.sleep(0.005)


def pages_equal(a, b, pages_a, pages_b, atol=0.0):
    for x, y in zip(a.owned_buffers(), b.owned_buffers()):
        assert torch.allclose(x[pages_a], y[pages_b], atol=atol, rtol=0), (x[pages_a] - y[pages_b]).abs().max()


@pytest.mark.parametrize("name", ["lossless", "fp8", "fp4", "mxfp4"])
def test_encode_decode_pages_per_buffer(name):
    p = pool()
    codec = get_codec(name)
    data = p.read_pages([1, 2, 3])
    rows = encode_pages(codec, data)
    shapes = PoolTransfer(p).shapes
    assert rows.shape == (3, page_nbytes(codec, shapes, torch.float32))
    out = decode_pages(codec, rows, shapes, torch.float32)
    for d, o in zip(data, out):
        assert o.shape == d.shape
        if name == "lossless":
            assert torch.equal(o, d)
        else:  # each buffer scaled on its own: error relative to that buffer's page amax
            tol = {"fp8": 0.07, "fp4": 0.35, "mxfp4": 0.35}[name]
            assert ((o - d).abs().amax(dim=(1, 2, 3)) <= tol * d.abs().amax(dim=(1, 2, 3))).all()
    # row i is page i alone: encoding pages one at a time gives the same bytes
    assert torch.equal(rows[1], encode_pages(codec, [d[1:2] for d in data])[0])


def test_host_roundtrip_and_pending_writes_are_waited_for():
    src = pool(0)
    t = io(src, host_codec="lossless")
    slots = t.host_alloc(3)
    t.device_to_host([1, 2, 3], slots)
    src.owned_buffers()[0][1:4] = 0  # the copy was captured before device_to_host returned
    job = LoadJob(sources=[(HOST, s) for s in slots], dest=[5, 6, 7])  # into the backend's own pool
    t.start_load(job)
    wait_done(job)
    assert job.num_loaded == 3 and job.page_tiers == [HOST] * 3
    assert job.bytes_by_tier[HOST] == 3 * t.host_page_nbytes
    pages_equal(pool(0), src, [1, 2, 3], [5, 6, 7])
    s = t.stats()
    assert s["host_pages_written"] == 3 and s["host_pages_read"] == 3
    assert s["host_bytes_written"] == 3 * t.host_page_nbytes
    t.close()


def test_disk_write_through_then_a_fresh_backend_finds_pages_by_key(tmp_path):
    src, dst = pool(0), pool(1)
    a = io(src, tmp_path, host_bytes=0)
    hashes = [bytes([i]) * 16 for i in range(4)]
    keys = [a.disk_key(h) for h in hashes]
    assert a.device_to_disk([1, 2, 3, 4], keys, ids(hashes))
    assert a.disk_contains(keys[0])  # pending counts as present, and a load waits for it
    job = LoadJob(sources=[], probe=keys, probe_ids=ids(hashes), dest=[5, 6, 7, 8])
    a.start_load(job)
    wait_done(job)
    assert job.num_loaded == 4
    assert a.close()
    b = io(dst, tmp_path, host_bytes=0)  # "another process": empty state, same directory
    assert b.disk_contains(keys[2])
    job = LoadJob(sources=[], probe=keys + [a.disk_key(b"\x09" * 16)],
                  probe_ids=ids(hashes + [b"\x09" * 16]), dest=[8, 9, 10, 11, 12])
    b.start_load(job)
    wait_done(job)
    assert job.num_loaded == 4 and job.failed_at is None  # the probe stops at the first miss
    assert job.bytes_by_tier[DISK] == 4 * b.disk_page_nbytes
    pages_equal(pool(0), dst, [1, 2, 3, 4], [8, 9, 10, 11])
    assert b.stats()["disk_bytes_read"] > 0
    b.close()


def test_other_files_write_in_the_background_and_read_back_checked(tmp_path):
    """``write_file``/``read_file`` (window snapshots): found by a fresh backend through the
    store's index, and a file of an unexpected size is a miss."""
    a = io(pool(), tmp_path, host_bytes=0)
    key = a.disk_key(b"\x05" * 16) + "ff"  # any hex key apart from the pages'
    payload = torch.arange(40, dtype=torch.uint8)
    page = page_id(b"\x05" * 16)
    assert a.write_file(key, lambda: payload, 40, token_count=8, page=page)
    assert a.disk_contains(key, indexed=True)  # pending counts as present
    assert a.close()
    assert a.stats()["disk_files_written"] == 1 and a.stats()["disk_pages_written"] == 0
    b = io(pool(), tmp_path, host_bytes=0)
    assert b.disk_contains(key, indexed=True) and not b.disk_contains("ab" * 16, indexed=True)
    assert bytes(b.read_file(key, 40, page)) == bytes(range(40))
    assert b.read_file(key, 41, page) is None and b.read_file("ab" * 16, 40, page) is None
    assert b.stats()["disk_files_read"] == 1
    b.close()


def test_l2_to_l3_transcodes_between_codecs(tmp_path):
    src = pool(0)
    t = io(src, tmp_path, host_codec="lossless", disk_codec="fp8")
    slots = t.host_alloc(2)
    t.device_to_host([1, 2], slots)
    hashes = [b"\x01" * 16, b"\x02" * 16]
    keys = [t.disk_key(h) for h in hashes]
    assert t.host_to_disk(slots, keys, ids(hashes))
    t.host_free(slots)  # freed at once: the read happens first (FIFO host worker)
    s2 = t.host_alloc(2)
    t.device_to_host([5, 6], s2)  # reuses the slots
    assert t.flush()
    job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=ids(hashes), dest=[7, 8])
    t.start_load(job)
    wait_done(job)
    assert job.num_loaded == 2 and not t.loader.direct_reads  # fp8: staged, decoded into L1
    pages_equal(pool(0), src, [1, 2], [7, 8], atol=0.3)
    t.close()


def test_failed_and_dropped_writes(tmp_path, monkeypatch):
    import deepinfer.kv.tiers.disk_store as ds

    p = pool()
    t = io(p, tmp_path, host_bytes=0)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds.os, "fsync", full)
    hashes = [bytes([i]) * 16 for i in range(2)]
    keys = [t.disk_key(h) for h in hashes]
    assert t.device_to_disk([1, 2], keys, ids(hashes))
    assert t.flush()
    assert sorted(t.poll_failed_writes()) == sorted(keys)
    assert t.stats()["disk_write_errors"] == 2
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]  # temp files removed
    monkeypatch.undo()
    tiny = io(p, tmp_path, host_bytes=0, max_pending_bytes=10)
    assert not tiny.device_to_disk([1], [keys[0]], ids(hashes[:1]))
    assert tiny.stats()["disk_writes_dropped"] == 1
    t.close()
    tiny.close()


def test_corrupt_file_stops_the_load_and_is_counted(tmp_path):
    p = pool()
    t = io(p, tmp_path, host_bytes=0)
    hashes = [bytes([i]) * 16 for i in range(3)]
    keys = [t.disk_key(h) for h in hashes]
    t.device_to_disk([1, 2, 3], keys, ids(hashes))
    t.flush()
    f = tmp_path / keys[1][:2] / f"{keys[1]}.kv"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=ids(hashes), dest=[4, 5, 6])
    t.start_load(job)
    wait_done(job)
    assert job.num_loaded == 1 and job.failed_at == 1
    assert t.stats()["disk"]["checksum_failures"] == 1 and not f.exists()
    t.close()


def test_unusable_directory_degrades_to_misses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = pool()
    t = io(p, blocker / "kv", host_bytes=0)
    k = t.disk_key(b"\x01" * 16)
    assert t.device_to_disk([1], [k], ids([b"\x01" * 16]))
    t.flush()
    assert t.poll_failed_writes() == [k] and not t.disk_contains(k)
    t.close()


def test_codec_block_must_divide_page_buffers():
    p = PagePool([KVSpec.gqa(1, 3)], 4, 1, torch.float32, torch.device("cpu"))  # 3 elements/page
    with pytest.raises(ValueError, match="block size"):
        TierIO(PoolTransfer(p), 1, "m", host_bytes=1 << 20, host_codec="fp8")


def test_close_flushes_and_is_idempotent(tmp_path):
    p = pool()
    t = io(p, tmp_path, host_bytes=0)
    keys = [t.disk_key(bytes([i]) * 16) for i in range(8)]
    for i, k in enumerate(keys):
        t.device_to_disk([1 + i], [k], ids([bytes([i]) * 16]))
    assert t.close() and t.close()
    assert len(list(tmp_path.glob("??/*.kv"))) == 8
    assert not t.device_to_disk([1], [t.disk_key(b"\x77" * 16)], ids([b"\x77" * 16]))  # closed: refused, not raised
    assert os.path.isdir(tmp_path)


def big_pool(n, seed=0):
    p = PagePool(SPECS, 2 * n + 2, PS, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for b in p.owned_buffers():
        b.copy_(torch.randn(b.shape, generator=g))
    return p


@pytest.mark.parametrize("codec", ["lossless", "fp8", "fp4"])
def test_parallel_l3_load_lands_in_the_dest_pages_in_chain_order(tmp_path, codec):
    n = 3 * PageLoader.POOL_CHUNK + 5  # several chunks of either size, one partial
    p = big_pool(n)
    t = io(p, tmp_path, host_bytes=0, disk_codec=codec, read_ahead=3)
    assert t.loader.direct_reads == (codec == "lossless")
    hs = [i.to_bytes(4, "little") * 4 for i in range(n)]
    keys = [t.disk_key(h) for h in hs]
    src = list(range(1, n + 1))
    assert t.device_to_disk(src, keys, ids(hs)) and t.flush()
    dest = list(range(n + 1, 2 * n + 1))
    job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=ids(hs), dest=dest)
    t.start_load(job)
    wait_done(job)
    assert job.num_loaded == n and job.failed_at is None and job.page_tiers == [DISK] * n
    # exactly what the codec's own decode gives (lossless: the very bytes)
    want = decode_pages(t.disk_codec, encode_pages(t.disk_codec, p.read_pages(src)), t.shapes,
                        torch.float32)
    for w, got in zip(want, p.read_pages(dest)):
        assert torch.equal(w, got)
    assert job.bytes_by_tier[DISK] == n * t.disk_page_nbytes == t.stats()["disk_bytes_read"]
    t.close()


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
@pytest.mark.parametrize("readers", [1, 2, 4])
def test_l3_chunks_tile_the_run_in_order_and_shrink_so_readers_finish_together(tmp_path, codec, readers):
    p = big_pool(1)
    t = io(p, tmp_path, host_bytes=0, disk_codec=codec)
    most = PageLoader.POOL_CHUNK if codec == "lossless" else t.loader.staged_pages
    for n in (0, 1, 7, 8, 9, 40, 129, 480, 1001):
        chunks = t.loader.chunks(n, readers)
        assert [i for c in chunks for i in c] == list(range(n))  # every page once, in chain order
        sizes = [len(c) for c in chunks]
        assert sizes == sorted(sizes, reverse=True)
        assert all(min(n, PageLoader.READ_CHUNK) <= s <= most for s in sizes[:-1])
        # each chunk is at most a readers-th of what is left: the last ones are small
        left = n
        for s in sizes:
            assert s <= max(PageLoader.READ_CHUNK, -(-left // readers))
            left -= s
    t.close()


def test_a_load_from_the_page_cache_runs_no_more_readers_than_cores(tmp_path):
    n = 24
    p = big_pool(n)
    t = io(p, tmp_path, host_bytes=0, disk_codec="fp8", read_ahead=4)
    hs = [i.to_bytes(4, "little") * 4 for i in range(n)]
    keys = [t.disk_key(h) for h in hs]
    assert t.device_to_disk(list(range(1, n + 1)), keys, ids(hs)) and t.flush()
    t.loader.cores = 2
    assert all(t.store.resident(k) for k in keys)  # just written
    assert t.loader.readers_for(keys) == 2
    for k in keys[n // 2:]:  # the run's middle and last files must come from the device
        fd = os.open(t.store.file_path(k), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    assert not t.store.resident(keys[-1]) and t.loader.readers_for(keys) == 4
    job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=ids(hs), dest=list(range(n + 1, 2 * n + 1)))
    t.start_load(job)
    wait_done(job)
    assert job.num_loaded == n
    want = decode_pages(t.disk_codec, encode_pages(t.disk_codec, p.read_pages(list(range(1, n + 1)))),
                        t.shapes, torch.float32)
    for w, got in zip(want, p.read_pages(list(range(n + 1, 2 * n + 1)))):
        assert torch.equal(w, got)
    t.close()


@pytest.mark.parametrize("how", ["reader dies", "file damaged"])
def test_a_failure_mid_load_applies_exactly_the_pages_before_it(tmp_path, how):
    n, bad = 4 * PageLoader.POOL_CHUNK, PageLoader.POOL_CHUNK + 3
    p = big_pool(n)
    t = io(p, tmp_path, host_bytes=0, read_ahead=4)
    hs = [i.to_bytes(4, "little") * 4 for i in range(n)]
    keys = [t.disk_key(h) for h in hs]
    assert t.device_to_disk(list(range(1, n + 1)), keys, ids(hs)) and t.flush()
    if how == "file damaged":
        f = tmp_path / keys[bad][:2] / f"{keys[bad]}.kv"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    elif t.loader.batch is None:
        read_into = t.store.read_into

        def dies(key, dest, expect=None):
            if key == keys[bad]:
                raise RuntimeError("loader killed mid-read")
            return read_into(key, dest, expect)

        t.store.read_into = dies
    else:  # the native batch reads the chunk's pages before the bad one, then its reader dies
        native = t.loader.batch._native

        def dies_in_batch(ks, pids, buffers, pages):
            if keys[bad] in ks:
                j = ks.index(keys[bad])
                assert native(ks[:j], pids[:j], buffers, pages[:j]) == j
                raise RuntimeError("loader killed mid-read")
            return native(ks, pids, buffers, pages)

        t.loader.batch._native = dies_in_batch
    job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=ids(hs),
                  dest=list(range(n + 1, 2 * n + 1)))
    t.start_load(job)
    wait_done(job)
    # a reader that dies in a native batch loses its chunk: only whole chunks before it count
    good = bad
    if how == "reader dies" and t.loader.batch:
        good = next(c.start for c in t.loader.chunks(n, t.loader.readers_for(keys)) if bad in c)
    assert job.num_loaded == good and job.failed_at == good
    assert job.page_tiers == [DISK] * good
    pages_equal(p, p, list(range(1, good + 1)), list(range(n + 1, n + good + 1)))
    if how == "file damaged":
        assert t.store.stats()["checksum_failures"] == 1
    t.close()
