"""Layer-wise loads: a hit's L3 page files read layer by layer, so its prefill need not wait.

The prefill of a hit's tail reads layer i's cached KV only in layer i. A streamed load
(``--kv-stream-layers``) therefore reads layer 0's K and V of every page first, then layer 1's,
and so on, and marks each layer ready in a ``LayerLoads`` handle the forward waits on per
layer (``ForwardBatch.for_layer``): layer i computes while layer i+1 loads.

Integrity: a page file's tag covers all of its layers, so it can be checked only after the last
one. The forward that ran on the streamed layers is therefore provisional: the cache manager
hands the pages to the tree only once their files checked out (``KVCacheManager.cache_pages``),
and if one did not, the request drops that step's result and recomputes from the first bad page
(nothing of a bad page ever becomes visible to another request). Lossless pages are read
straight into their L1 buffers; other codecs into a staging row per page, decoded one layer at
a time. CPU pools only.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, wait

import torch

from .batch_reads import BatchReads
from .codec_base import Codec
from .disk_file import BadFile, PageFormat, PageId, TagHasher, tag_nbytes
from .disk_store import DiskStore
from .page_bytes import KVTransfer, write_decoded

PIECE_GROUPS = 4  # layer groups a native read takes at once after the first (``_pieces``)


class LayerLoads:
    """Per model layer, whether its KV of every streamed page is in L1. ``fail`` releases every
    waiter at once (the load ended early: the forward's result is dropped)."""

    def __init__(self, layer_group: list[int], num_groups: int) -> None:
        self._group = layer_group
        self._ready = [threading.Event() for _ in range(num_groups)]

    def wait(self, layer: int) -> None:
        self._ready[self._group[layer]].wait()

    def mark(self, group: int) -> None:
        self._ready[group].set()

    def fail(self) -> None:
        for ev in self._ready:
            ev.set()


def stream_pages(store: DiskStore, transfer: KVTransfer, codec: Codec, keys: list[str],
                 ids: list[PageId | None], dest: list[int], loads: LayerLoads,
                 cancelled: Callable[[], bool], batch: BatchReads | None = None,
                 readers: Executor | None = None, num_readers: int = 1) -> int:
    """Read L3 pages ``keys`` into L1 pages ``dest`` layer by layer, marking each layer of
    ``loads`` once every page still in the run has it. -> the leading pages whose files were
    read whole and checked out (a page that fails ends the run: the pages after it are not
    read further, and count neither as hits nor as misses). With ``batch`` (a plain directory
    the native op reads) and every page's id known, the op reads ``num_readers`` slices of the
    pages on ``readers`` in parallel (``_stream_native``); else one file piece per ``preadv``."""
    nbytes = [codec.encoded_nbytes((math.prod(s),), transfer.dtype) for s in transfer.shapes]
    direct = codec.name == "lossless" and transfer.page_views(0) is not None
    if batch is not None and readers is not None and keys and all(p is not None for p in ids):
        return _stream_native(batch, transfer, codec, nbytes, direct, keys, ids, dest, loads,
                              cancelled, readers, num_readers)
    fmt: PageFormat = store.format
    files: list[_OpenPage] = []
    bad: tuple[int, BadFile | OSError] | None = None  # the first page that failed, and why
    try:
        for key in keys:  # headers first: the run is at most the pages whose header is right
            fd = store.open_page(key)
            if fd is None:
                break
            try:
                header, head, _ = fmt.read_head(fd, key, sum(nbytes))
                hasher = fmt.hasher(header["tag_alg"])
            except (BadFile, OSError) as e:
                store.close_page(key, fd, e)
                break
            hasher.update(head)
            files.append(_OpenPage(fd, header, hasher, len(head)))
        off = 0
        for g, bufs in enumerate(transfer.buffer_groups):
            width = sum(nbytes[j] for j in bufs)
            n = len(files) if bad is None else bad[0]
            rows = None if direct else torch.empty(n, width, dtype=torch.uint8)
            for p in range(n):
                if cancelled():
                    return 0
                f = files[p]
                views = ([transfer.page_views(dest[p])[j] for j in bufs] if rows is None
                         else [memoryview(rows[p].numpy())])
                try:
                    if os.preadv(f.fd, views, f.payload_at + off) != width:
                        raise BadFile("corrupt", "short read (truncated meanwhile?)")
                except (BadFile, OSError) as e:
                    bad = (p, e)
                    break
                for v in views:
                    f.hasher.update(v)
            n = len(files) if bad is None else bad[0]
            if rows is not None and n:
                write_decoded(codec, rows[:n], transfer, dest[:n], bufs)
            off += width
            loads.mark(g)
        for p, f in enumerate(files[: len(files) if bad is None else bad[0]]):
            n_tag = tag_nbytes(f.header["tag_alg"])
            try:
                fmt.check(f.header, f.hasher.digest(), os.pread(f.fd, n_tag, f.size - n_tag), ids[p])
            except (BadFile, OSError) as e:
                bad = (p, e)
                break
        good = len(files) if bad is None else bad[0]
        for p, (key, f) in enumerate(zip(keys, files)):  # hits, the miss, the rest unread
            if p < good:
                store.close_page(key, f.fd, None, f.size, f.header["payload_len"])
            elif bad is not None and p == good:
                store.close_page(key, f.fd, bad[1])
            else:
                os.close(f.fd)
        files = []
        return good
    finally:
        loads.fail()  # no waiter outlives the load
        for f in files:  # cancelled, or an unexpected error: nothing counts
            os.close(f.fd)


def _stream_native(batch: BatchReads, transfer: KVTransfer, codec: Codec, nbytes: list[int],
                   direct: bool, keys: list[str], ids: list[PageId | None], dest: list[int],
                   loads: LayerLoads, cancelled: Callable[[], bool], readers: Executor,
                   num_readers: int) -> int:
    """``stream_pages`` through the native ``LayerReads``: the pages cut into contiguous slices,
    one per reader thread, each reading its files a piece of layer groups at a time
    (``_pieces``: a ``preadv`` per file and piece, no GIL held); a group is marked once every
    slice has it. The first page
    that fails ends the run; it goes down the store's precise path, which counts and
    quarantines it (its bytes into a scratch buffer: the forward may be reading its L1 page)."""
    n = len(keys)
    groups = transfer.buffer_groups
    k = max(1, min(num_readers, n))
    bounds = [n * r // k for r in range(k + 1)]
    host = transfer.host_buffers() if direct else None
    arrived = [0] * len(groups)
    lock = threading.Lock()
    first = sum(nbytes[j] for j in groups[0])

    def run_slice(lo: int, hi: int) -> tuple[int, list[int]]:
        reads, sizes = batch.open_layers(keys[lo:hi], ids[lo:hi], first)  # type: ignore[arg-type]
        live, off, pages = reads.opened(), 0, torch.tensor(dest[lo:hi])
        try:
            for piece in _pieces(len(groups)):
                bufs = range(groups[piece.start].start, groups[piece.stop - 1].stop)
                width = sum(nbytes[j] for j in bufs)
                if live and not cancelled():
                    if host is not None:
                        live = reads.read([host[j] for j in bufs], pages, off)
                    else:
                        rows = torch.empty(hi - lo, width, dtype=torch.uint8)
                        live = reads.read([rows], torch.arange(hi - lo), off)
                        if live:
                            write_decoded(codec, rows[:live], transfer, dest[lo : lo + live], bufs)
                off += width
                with lock:
                    for g in piece:
                        arrived[g] += 1
                        if arrived[g] == k:
                            loads.mark(g)
        finally:
            live = reads.finish(batch.store.touch_on_hit)
        return (0 if cancelled() else live), sizes

    futs = [readers.submit(run_slice, bounds[r], bounds[r + 1]) for r in range(k)]
    wait(futs)  # every slice ends before the pages can be freed, even if one raised
    good, sizes = 0, []
    for r, f in enumerate(futs):
        live, got = f.result()
        good, sizes = good + live, sizes + got[:live]
        if live < bounds[r + 1] - bounds[r]:
            break
    batch.count_hits(keys[:good], sizes)
    if good < n and not cancelled():
        scratch = memoryview(bytearray(batch.payload_len))
        batch.store.read_into(keys[good], [scratch], ids[good])  # classified, counted, quarantined
    return good


def _pieces(num_groups: int) -> list[range]:
    """The layer groups each native read takes: the first alone (the forward waits for it), then
    ``PIECE_GROUPS`` at a time. After layer 0 the reads run ahead of the forward (a layer's
    compute takes longer than reading that layer of every page), and each read costs a system
    call per file: 480 files x 30 layers were 14,400 calls a load."""
    starts = [0, *range(1, num_groups, PIECE_GROUPS)] if num_groups else []
    return [range(a, b) for a, b in zip(starts, [*starts[1:], num_groups])]


class _OpenPage:
    """One page file being read in pieces: its descriptor, header and running tag."""

    def __init__(self, fd: int, header: dict, hasher: TagHasher, payload_at: int) -> None:
        self.fd, self.header, self.hasher, self.payload_at = fd, header, hasher, payload_at
        self.size = payload_at + header["payload_len"] + tag_nbytes(header["tag_alg"])
