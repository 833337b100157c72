"""L3 -> L1 load throughput next to a plain read of the same files (issue 17); no model needed.

A SmolLM2-135M-shaped pool (30 layers, 3 KV heads x 64, page 16, fp32: 738 KB page files;
``--dtype bfloat16``, the TTFT runs' pool: 369 KB) and ``--pages`` page files written through
``TierIO``. Per round, alternating, with the files in the
page cache and then dropped from it (``posix_fadvise``): ``raw``, a plain read loop over the
files; ``copy``, open + one ``preadv`` per file into its L1 page (the floor of a load that lands
in place, no check); ``copy+tag``, the same plus XXH3-128 over each page right after it landed
(the floor with the integrity check, one thread); ``layers``, the layer-major read a layer-wise
stream would do over these page files: every file opened and its header read, then per layer one
``preadv`` of that layer's K and V slice from each file, each file's tag updated as its layers
arrive and checked after the last (one thread); ``store``, ``DiskStore.read_into`` on one
thread (read + header + tag check); ``load``, whole ``PageLoader`` loads on the reader threads
(what a request waits for: a chunk of files per native call, ``batch_reads.py``); ``load-py``,
the same loads with the per-page Python reads (``DiskStore.read_into``); for lossy codecs also ``load-torch``, the same loads decoded by the
torch ops instead of the native decode (``native_pages.py``), into a second pool that must come
out bit-identical. Prints seconds (best of the rounds), each one's speed as a share of ``raw``
and the CPU seconds the process spent (best of the rounds; steadier than wall time where other
work shares the cores) and the most minor page faults one round took; ``raw`` reads into one reused
buffer that stays in the CPU cache, ``raw-distinct`` the same files into distinct memory touched
beforehand (the bound for a load, which writes 384 MB of distinct, already touched L1 memory).

    python benchmarks/l3_load.py [--pages 520] [--codecs lossless,fp8,fp4] [--rounds 3]
        [--readers 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import deepinfer  # noqa: E402, F401  (first: sets the OpenMP wait policy before torch loads)
import torch  # noqa: E402
import xxhash  # noqa: E402
from tiers import drop_page_cache  # noqa: E402

from deepinfer.hardware import lscpu_model  # noqa: E402
from deepinfer.kv.layout import KVSpec  # noqa: E402
from deepinfer.kv.pool import PagePool  # noqa: E402
from deepinfer.kv.radix import DISK  # noqa: E402
from deepinfer.kv.tiers.backend import LoadJob  # noqa: E402
from deepinfer.kv.tiers.disk_file import page_id  # noqa: E402
from deepinfer.kv.tiers.disk_store import DiskStore  # noqa: E402
from deepinfer.kv.tiers.page_bytes import PoolTransfer  # noqa: E402
from deepinfer.kv.tiers.tier_io import TierIO  # noqa: E402

PAGE = 16
SPECS = [KVSpec.gqa(3, 64) for _ in range(30)]  # SmolLM2-135M


class TorchDecodeTransfer(PoolTransfer):
    """A pool the native decode does not write into: pages decode through the torch ops."""

    def host_buffers(self) -> None:
        return None


def tier_io(pool: PagePool, disk: str, codec: str, readers: int, native: bool = True) -> TierIO:
    transfer = PoolTransfer(pool) if native else TorchDecodeTransfer(pool)
    return TierIO(transfer, PAGE, "bench", disk_dir=disk, disk_bytes=1 << 40,
                  disk_codec=codec, read_ahead=readers)


def seconds(fn: Callable[[], None]) -> tuple[float, float, int]:
    """-> (wall seconds, CPU seconds of the whole process: on a shared machine the steadier,
    minor page faults: whether the case wrote into memory it touched for the first time)."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    return t1 - t0, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def one_codec(codec: str, n: int, rounds: int, readers: int, work: Path,
              dtype: torch.dtype = torch.float32) -> dict[str, dict]:
    src = PagePool(SPECS, n + 1, PAGE, dtype, torch.device("cpu"))
    for b in src.owned_buffers():
        b.copy_(torch.randn(b.shape))
    disk = str(work / codec)
    keys = [f"{i:032x}" for i in range(n)]
    ids = [page_id(i.to_bytes(16, "little"), list(range(i, i + PAGE))) for i in range(n)]
    writer = tier_io(src, disk, codec, readers)
    for i in range(0, n, 32):
        assert writer.device_to_disk(list(range(1 + i, 1 + min(n, i + 32))), keys[i : i + 32],
                                     ids[i : i + 32])
    assert writer.close()
    store = DiskStore(disk, 1 << 40, writer.namespace)
    files = [store.file_path(k) for k in keys]
    nbytes = sum(os.path.getsize(f) for f in files)
    dst = PagePool(SPECS, n + 1, PAGE, dtype, torch.device("cpu"))
    for b in dst.owned_buffers():
        b.fill_(1.0)  # touched: no page faults in the first round
    tr = PoolTransfer(dst)
    loader = tier_io(dst, disk, codec, readers)
    dst_torch = PagePool(SPECS, n + 1, PAGE, dtype, torch.device("cpu"))
    if codec != "lossless":
        for b in dst_torch.owned_buffers():
            b.fill_(1.0)
    torch_loader = tier_io(dst_torch, disk, codec, readers, native=False)
    py_loader = tier_io(dst, disk, codec, readers)
    py_loader.loader.batch = None  # the per-page path, for the comparison

    def raw() -> None:
        for p in files:
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass

    sizes = [os.path.getsize(f) for f in files]
    flat = torch.ones(sum(sizes), dtype=torch.uint8)  # touched: no page faults
    spans = [memoryview(flat[a - b : a].numpy()) for a, b in
             zip(torch.tensor(sizes).cumsum(0).tolist(), sizes)]

    def raw_distinct() -> None:
        for p, span in zip(files, spans):
            with open(p, "rb", buffering=0) as f:
                f.readinto(span)

    def copy() -> None:
        for i, p in enumerate(files):
            fd = os.open(p, os.O_RDONLY)
            os.preadv(fd, tr.page_views(i + 1), 0)
            os.close(fd)

    head = store.format.head(keys[0], tr.page_views(1)[0].nbytes * len(SPECS) * 2, PAGE, ids[0])
    hlen = len(head)  # every file of this store has a header of this length

    def copy_tag() -> None:
        for i, p in enumerate(files):
            fd = os.open(p, os.O_RDONLY)
            views = tr.page_views(i + 1)
            h, tag = bytearray(hlen), bytearray(16)
            os.preadv(fd, [h, *views, tag], 0)
            os.close(fd)
            x = xxhash.xxh3_128(h)
            for v in views:
                x.update(v)
            assert x.digest() == tag

    def layers() -> None:
        fds = [os.open(p, os.O_RDONLY) for p in files]
        tags = []
        for fd in fds:
            h = bytearray(hlen)
            os.preadv(fd, [h], 0)
            tags.append(xxhash.xxh3_128(h))
        views = [tr.page_views(i + 1) for i in range(n)]
        for layer in range(len(SPECS)):  # K then V of a layer are adjacent in a page's payload
            off = hlen + sum(v.nbytes for v in views[0][: 2 * layer])
            for fd, v, x in zip(fds, views, tags):
                kv = v[2 * layer : 2 * layer + 2]
                os.preadv(fd, kv, off)
                x.update(kv[0])
                x.update(kv[1])
        for fd, v, x in zip(fds, views, tags):
            tag = os.pread(fd, 16, hlen + sum(b.nbytes for b in v))
            os.close(fd)
            assert x.digest() == tag

    def read_into() -> None:
        for i, k in enumerate(keys):
            assert store.read_into(k, tr.page_views(i + 1), ids[i])

    def load(into: TierIO = loader) -> None:
        job = LoadJob(sources=[(DISK, k) for k in keys], source_ids=list(ids),
                      dest=list(range(1, n + 1)))
        into.start_load(job)
        while not job.done:
            into.wait(1.0)
        assert job.num_loaded == n, job.num_loaded

    cases = {"raw": raw, "raw-distinct": raw_distinct, "load": load, "load-py": lambda: load(py_loader)}
    if codec != "lossless":
        cases["load-torch"] = lambda: load(torch_loader)
    else:  # the in-place floor and the one-thread check (other codecs decode)
        cases.update({"copy": copy, "copy+tag": copy_tag, "layers": layers, "store": read_into})
    out: dict[str, dict] = {}
    for state in ("cached", "cold"):
        best = {name: float("inf") for name in cases}
        cpu, faults = dict(best), dict.fromkeys(cases, 0)
        for _ in range(rounds):
            for name, fn in cases.items():
                if state == "cold":
                    drop_page_cache(files)
                else:
                    raw()
                wall, used, flt = seconds(fn)
                best[name], cpu[name] = min(best[name], wall), min(cpu[name], used)
                faults[name] = max(faults[name], flt)
        out[state] = {"bytes": nbytes, "seconds": best, "cpu_seconds": cpu, "minflt": faults,
                      "vs_raw": {k: best["raw"] / v for k, v in best.items()}}
    for a, b, c in zip(src.owned_buffers(), dst.owned_buffers(), dst_torch.owned_buffers()):
        if codec == "lossless":
            assert torch.equal(a[1:], b[1:])  # the loads were exact
        else:
            assert torch.equal(b[1:], c[1:])  # native and torch decode agree bit for bit
    for t in (loader, torch_loader, py_loader):
        t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=520)  # an 8K-token SmolLM2 prompt
    ap.add_argument("--codecs", default="lossless,fp8,fp4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])  # bf16: the TTFT runs' pool
    args = ap.parse_args()
    print(f"CPU: {lscpu_model()} ({os.cpu_count()} CPUs); {args.pages} SmolLM2 page files, "
          f"{args.dtype}, {args.readers} readers, best of {args.rounds} alternating rounds", flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-l3load-") as tmp:
        for codec in args.codecs.split(","):
            res = one_codec(codec, args.pages, args.rounds, args.readers, Path(tmp), getattr(torch, args.dtype))
            for state, r in res.items():
                cells = "  ".join(f"{k} {s:.3f} s ({r['vs_raw'][k]:.2f}x, cpu {r['cpu_seconds'][k]:.3f} s, "
                                  f"{r['minflt'][k]} faults)"
                                  for k, s in r["seconds"].items())
                print(f"{codec:8s} {state:6s} {r['bytes'] / 1e6:.0f} MB: {cells}", flush=True)


if __name__ == "__main__":
    main()
