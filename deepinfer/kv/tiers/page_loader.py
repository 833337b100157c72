"""Loads: a ``LoadJob``'s pages from L2 slots and L3 files into the L1 pages reserved for it.

One loader thread per job (``loaders`` of them) walks the job in chain order. L2 slots are
decoded into their pages. L3 pages are spread over the reader threads (``readers``), each taking
the next chunk of pages (``chunks``), so the pages the prefill needs first land first. A lossless page
in host memory is read with one ``preadv`` straight into its L1 buffers and checked there: no
intermediate copy. From a plain directory a reader's whole chunk is one native call without the
GIL (``batch_reads.py``), elsewhere one ``PageStore.read_into`` per page. Other codecs, and CUDA,
go through a staging buffer per reader (pinned on CUDA) whose pages are decoded together into their L1 pages
(natively, straight into a CPU pool: ``native_pages.py``; on a side stream on CUDA). The first page that cannot be read ends the load: the pages before it are
in place, nothing after it counts (``job.num_loaded``), and the cache manager frees the rest
(a reader that fails inside a native call counts none of that chunk's pages).
A job with ``layers`` streams layer by layer instead (``layer_stream.py``): natively on the
reader threads where the chunks are read natively, else on its loader thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...threads import available_cores
from ..radix import DISK, HOST
from .backend import LoadJob
from .batch_reads import BatchReads
from .codec_base import Codec
from .disk_file import PageId
from .disk_store import DiskStore
from .layer_stream import LayerLoads, stream_pages
from .page_store import LOCAL, PageStore
from .native_pages import native_decodes
from .page_bytes import KVTransfer, write_decoded

log = logging.getLogger(__name__)


class PageLoader:
    """Runs ``LoadJob``s for ``TierIO`` (which owns the stores, the codecs and the writers)."""

    READ_CHUNK = 8  # consecutive L3 pages one reader takes at a time, at least (``chunks``)
    POOL_CHUNK = 32  # at most
    STAGING_BYTES = 8 << 20  # a reader's staging rows hold at most this much (or READ_CHUNK pages)

    def __init__(self, transfer: KVTransfer, host_codec: Codec, disk_codec: Codec,
                 host_page_nbytes: int, disk_page_nbytes: int, store: PageStore | None,
                 read_host: Callable[[list[int]], torch.Tensor],
                 wait_written: Callable[[str], None], side: Any, *,
                 loaders: int = 2, readers: int = 4, page_size: int = 0) -> None:
        self.transfer = transfer
        self.shapes, self.dtype, self.device = transfer.shapes, transfer.dtype, transfer.device
        self.cuda = self.device.type == "cuda"
        self.host_codec, self.disk_codec = host_codec, disk_codec
        self.host_page_nbytes, self.disk_page_nbytes = host_page_nbytes, disk_page_nbytes
        self.store = store
        # layer-wise loads read a plain directory into a CPU pool whose every layer reads a group
        streams = not self.cuda and min(transfer.layer_group, default=-1) >= 0
        self.stream_store = store if streams and isinstance(store, DiskStore) else None
        self.read_host = read_host  # L2 slots -> rows, after their pending writes
        self.wait_written = wait_written  # returns once an L3 key's pending write has landed
        self._side = side  # CUDA side stream (None on CPU)
        self.num_readers = readers
        self.cores = available_cores()
        # lossless pages in host memory are read straight into their L1 buffers
        self.direct_reads = disk_codec.name == "lossless" and transfer.page_views(0) is not None
        # a plain directory's pages read and checked natively, a chunk per call (no GIL held)
        self._pool_buffers = transfer.host_buffers() if self.direct_reads else None
        batches = page_size and (self._pool_buffers is not None or not self.direct_reads)
        self.batch = BatchReads.make(store, page_size, disk_page_nbytes) if batches else None
        if not self.cuda:  # build or load the native decode now, not in a request's load
            native_decodes(disk_codec, self.dtype)
        # encoded pages a reader stages (and decodes together)
        self.staged_pages = max(self.READ_CHUNK,
                                min(self.POOL_CHUNK, self.STAGING_BYTES // max(1, disk_page_nbytes)))
        self._staging: dict[int, torch.Tensor] = {}  # reader thread -> staged_pages rows
        self._jobs = ThreadPoolExecutor(loaders, thread_name_prefix="deepinfer-kv-loader")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="deepinfer-l3-reader")
        self._cv = threading.Condition()
        self._running = 0
        self.counters = dict.fromkeys(["disk_pages_read", "disk_bytes_read", "load_errors",
                                       "disk_pages_streamed"], 0)

    def stream_layers(self, job: LoadJob) -> bool:
        """``TierBackend.stream_layers``: every page from L3, and a store and pool that can.
        The probe is cut to the leading files present (a stat each): the request's streamed
        step counts every page it is given, so a probed page past the stored run (the prompt's
        new tail, when the tree did not know the files) would cost that step again."""
        if self.stream_store is None or any(t != DISK for t, _ in job.sources):
            return False
        present = 0
        while present < len(job.probe) and self.stream_store.contains(job.probe[present]):
            present += 1
        job.truncate(len(job.sources) + present)
        job.layers = LayerLoads(self.transfer.layer_group, len(self.transfer.buffer_groups))
        return True

    def start(self, job: LoadJob) -> None:
        ready = None
        if self.cuda:  # the dest pages may still be in use by queued kernels of their last owner
            ready = torch.cuda.Event()
            ready.record()
        with self._cv:
            self._running += 1
        self._jobs.submit(self._run, job, ready)

    def _run(self, job: LoadJob, ready: Any) -> None:
        """Fill ``job.dest`` in chain order: L2 runs on this thread, L3 runs spread over the
        reader threads; ``num_loaded`` is the leading run of pages in place."""
        pages = (list(job.sources) + [(DISK, k) for k in job.probe])[: len(job.dest)]
        # the page each file must hold (None: unchecked, e.g. an L2 slot)
        ids = ((job.source_ids or [None] * len(job.sources))
               + (job.probe_ids or [None] * len(job.probe)))[: len(job.dest)]
        tiers: list[int] = []
        origins: list[str] = []
        try:
            if self.cuda:
                self._side.wait_event(ready)
            i = len(pages) if job.layers is not None else 0
            if job.layers is not None:  # layer by layer, all from L3 (``layer_stream.py``)
                assert self.stream_store is not None
                t0 = time.perf_counter()
                n = stream_pages(self.stream_store, self.transfer, self.disk_codec,
                                 [k for _, k in pages], ids, job.dest, job.layers,
                                 lambda: job.cancelled, self.batch, self._readers, self.num_readers)
                job.seconds_by_tier[DISK] += time.perf_counter() - t0
                job.bytes_by_tier[DISK] += n * self.disk_page_nbytes
                tiers, origins = [DISK] * n, [LOCAL] * n
                if n < len(pages) and n < len(job.sources):
                    job.failed_at = n
            while i < len(pages) and not job.cancelled:
                tier, j = pages[i][0], i
                while j < len(pages) and pages[j][0] == tier:
                    j += 1
                t0 = time.perf_counter()
                srcs, dest = [s for _, s in pages[i:j]], job.dest[i:j]
                got = ([LOCAL] * self._load_host(srcs, dest) if tier == HOST
                       else self._load_disk(srcs, ids[i:j], dest, job))
                n = len(got)
                origins += got
                job.seconds_by_tier[tier] += time.perf_counter() - t0
                job.bytes_by_tier[tier] += n * (self.host_page_nbytes if tier == HOST
                                                else self.disk_page_nbytes)
                tiers += [tier] * n
                if n < j - i:
                    if i + n < len(job.sources):
                        job.failed_at = i + n
                    break
                i = j
        except Exception:  # noqa: BLE001 - a failed load is a miss, never an error
            log.exception("KV load failed")
            with self._cv:
                self.counters["load_errors"] += 1
            tiers, origins = [], []
            if job.failed_at is None and job.sources:
                job.failed_at = 0
        finally:
            if self.cuda:  # the main thread reads (or frees) the pages on its own stream
                self._side.synchronize()
            if job.layers is not None:
                job.layers.fail()  # no forward waits on a load that ended
        job.page_tiers = tiers
        job.page_origins = origins
        job.num_loaded = len(tiers)
        job.seconds = time.perf_counter() - job.t_start
        with self._cv:
            self.counters["disk_pages_read"] += tiers.count(DISK)
            self.counters["disk_bytes_read"] += job.bytes_by_tier[DISK]
            self.counters["disk_pages_streamed"] += len(tiers) if job.layers is not None else 0
            job.done = True
            self._running -= 1
            self._cv.notify_all()

    def _load_host(self, slots: list[int], dest: list[int]) -> int:
        rows = self.read_host(slots)
        with torch.cuda.stream(self._side) if self.cuda else contextlib.nullcontext():
            # synchronous: ``rows`` is freed on return
            write_decoded(self.host_codec, rows.to(self.device), self.transfer, dest)
        return len(slots)

    def _load_disk(self, keys: list[str], ids: list[PageId | None], dest: list[int],
                   job: LoadJob) -> list[str]:
        """Read L3 pages into ``dest`` on the reader threads (``readers_for``), each taking the
        next chunk (``chunks``) in chain order; the first miss stops the pages after it.
        -> per leading page in place: where it came from (``page_store.py``'s origins)."""
        done: dict[int, tuple[list[str], int]] = {}  # chunk start -> (pages in place, length)
        readers = self.readers_for(keys)
        chunks = self.chunks(len(keys), readers)
        nxt, stop = [0], [len(keys)]
        lock = threading.Lock()

        def reader() -> None:
            while True:
                with lock:
                    if nxt[0] >= len(chunks) or chunks[nxt[0]].start >= stop[0] or job.cancelled:
                        return
                    c = chunks[nxt[0]]
                    nxt[0] += 1
                i, j = c.start, min(c.stop, stop[0])
                ok = self._read_pages(keys[i:j], ids[i:j], dest[i:j])
                done[i] = (ok, j - i)
                if len(ok) < j - i:
                    with lock:
                        stop[0] = min(stop[0], i + len(ok))

        for f in [self._readers.submit(reader) for _ in range(min(readers, len(chunks)))]:
            f.result()
        out: list[str] = []
        while len(out) in done:
            ok, length = done[len(out)]
            out += ok
            if len(ok) < length:
                break
        return out

    def readers_for(self, keys: list[str]) -> int:
        """Reader threads for a run of L3 pages: all of them where the files must come from the
        device (each keeps a read in flight), no more than the cores where the run's first,
        middle and last files are in the OS page cache: the load is then memory work, and
        threads beyond the cores only take turns (and each other's CPU caches)."""
        assert self.store is not None
        probe = {keys[0], keys[len(keys) // 2], keys[-1]} if keys else set()
        if self.cores < self.num_readers and probe and all(self.store.resident(k) for k in probe):
            return self.cores
        return self.num_readers

    def chunks(self, n: int, readers: int) -> list[range]:
        """A run of ``n`` L3 pages cut into the chunks ``readers`` threads take in turn, in chain
        order. Each is a ``readers``-th of the pages left, so the chunks shrink towards the end and
        the readers finish together (equal chunks left one reader idle for a chunk's time at the
        end, an eighth of a 480-page load on two readers); at most what a reader's staging rows
        hold (``staged_pages``), or ``POOL_CHUNK`` where chunks are read natively straight into
        the pool; ``READ_CHUNK`` at least: a chunk has a fixed cost (its Python side, the native
        calls' conversion of the buffers). Page by page straight into the pool (no native
        reads): ``READ_CHUNK`` each."""
        most = (self.READ_CHUNK if self.direct_reads and self.batch is None
                else self.POOL_CHUNK if self._pool_buffers is not None else self.staged_pages)
        out: list[range] = []
        i = 0
        while i < n:
            size = max(self.READ_CHUNK, min(most, -(-(n - i) // readers)))
            out.append(range(i, min(n, i + size)))
            i = out[-1].stop
        return out

    def _read_pages(self, keys: list[str], ids: list[PageId | None], dest: list[int]
                    ) -> list[str]:
        """Consecutive L3 pages into L1 pages ``dest``: each straight into its buffers when
        lossless in host memory, else into this thread's staging rows, decoded together.
        -> per leading page in place (a failure stops the chunk): where it came from."""
        assert self.store is not None
        got: list[str] = []
        try:
            if self.batch is not None:
                return self._read_batch(keys, ids, dest)
            if self.direct_reads:
                for key, pid, page in zip(keys, ids, dest):
                    self.wait_written(key)
                    if not self.store.read_into(key, self.transfer.page_views(page), pid):
                        break
                    got.append(self.store.last_read_origin())
                return got
            rows = self._staging_rows()
            for key, pid in zip(keys, ids):
                self.wait_written(key)
                if not self.store.read_into(key, [memoryview(rows[len(got)].numpy())], pid):
                    break
                got.append(self.store.last_read_origin())
            self._decode_staged(len(got), dest)
        except Exception:  # noqa: BLE001 - a page that cannot be applied is a miss
            log.exception("L3 pages %s... could not be loaded", keys[0])
            with self._cv:
                self.counters["load_errors"] += 1
        return got

    def _read_batch(self, keys: list[str], ids: list[PageId | None], dest: list[int]) -> list[str]:
        """``_read_pages`` through ``BatchReads``: the chunk's files in one native call."""
        assert self.batch is not None
        for key in keys:
            self.wait_written(key)
        if self._pool_buffers is not None:  # lossless into a CPU pool: straight into L1
            n = self.batch.read(keys, ids, self._pool_buffers, dest,
                                lambda i: self.transfer.page_views(dest[i]) or [])
            return [LOCAL] * n
        rows = self._staging_rows()
        n = self.batch.read(keys, ids, [rows], range(len(keys)),
                            lambda i: [memoryview(rows[i].numpy())])
        self._decode_staged(n, dest)
        return [LOCAL] * n

    def _decode_staged(self, n: int, dest: list[int]) -> None:
        """This thread's first ``n`` staging rows decoded into L1 pages ``dest[:n]``."""
        rows = self._staging_rows()
        if n:
            with torch.cuda.stream(self._side) if self.cuda else contextlib.nullcontext():
                # synchronous: the staging rows are reused
                write_decoded(self.disk_codec, rows[:n].to(self.device), self.transfer, dest[:n])

    def _staging_rows(self) -> torch.Tensor:
        """This reader thread's ``staged_pages`` page rows (pinned on CUDA), made once."""
        tid = threading.get_ident()
        if tid not in self._staging:
            self._staging[tid] = torch.empty(self.staged_pages, self.disk_page_nbytes,
                                             dtype=torch.uint8, pin_memory=self.cuda)
        return self._staging[tid]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until some load finishes (or ``timeout``); False if none was running."""
        with self._cv:
            if self._running == 0:
                return False
            self._cv.wait(timeout)
            return True

    def stats(self) -> dict[str, int]:
        with self._cv:
            return dict(self.counters)

    def close(self, wait: bool) -> None:
        for ex in (self._jobs, self._readers):
            ex.shutdown(wait=wait, cancel_futures=not wait)
