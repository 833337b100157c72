"""Data movement of the lower KV tiers: the engine's ``TierBackend``.

``TierIO`` moves pages between the device pool (through a ``KVTransfer``), the L2 host store
(``HostStore`` slots, pinned on CUDA) and the L3 page store (a ``PageStore``: ``DiskStore``
files, a networked ``RemoteStore``, or both), encoding with a codec per tier (a page's bytes:
``page_bytes.py``). Policy (what moves where, when,
capacity) lives in ``policy.py``.

Threads, so that neither decoding nor the scheduler waits on a copy:

* host writer (one, FIFO): encodes pages evicted from L1 into their L2 slots, and reads L2
  slots that go down to L3. The L1 data is captured (one gather) before ``device_to_host``
  returns, so the caller frees the L1 pages at once. A reader of a slot waits for the
  slot's pending write.
* disk writer (one, FIFO): encodes and writes L3 files (write-through, L2 evictions, and
  ``write_file``'s files that are no tree page: window snapshots).
  Bounded by ``max_pending_bytes``: beyond it a write is refused (the page simply is not on
  disk), never waited for. Failures are reported to the tier manager (``poll_failed_writes``).
* loaders: ``PageLoader`` (``page_loader.py``) brings a ``LoadJob``'s pages into the L1 pages
  the cache manager reserved for it, with its own loader and reader threads.
* promoter (one): reads L3 pages into L2 slots for the idle-time promotion
  (``promotion.py``), transcoding where the tiers' codecs differ.

On CUDA: host slots are pinned, device->host copies are ``non_blocking`` on a side stream
whose completion the writer thread waits for, and loads decode on a side stream.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ...log_limit import RateLimitedLog
from .backend import MOVES, LoadJob, TierBackend
from .codec_base import Codec
from .codecs import get_codec
from .host_store import HostStore
from .page_bytes import KVTransfer, check_codec, decode_pages, encode_pages, page_nbytes
from .page_loader import PageLoader
from .disk_file import PageId
from .page_store import PageStore
from .remote_store import RemoteStore
from .store_clients import open_l3_store

log = logging.getLogger(__name__)
PUBLISH_BATCH = 64  # pages per store call of ``publish`` (a radix node's worth at most)


class TierIO(TierBackend):
    """The engine's tier backend: codecs, host slots, disk files, background threads."""

    def __init__(self, transfer: KVTransfer, page_size: int, namespace: str, *,
                 host_bytes: int = 0, host_codec: str = "lossless",
                 disk_dir: str | os.PathLike[str] | None = None, disk_bytes: int = 0,
                 disk_codec: str = "lossless", disk_secret: bytes | None = None,
                 kv_store: str | None = None, kv_store_options: dict[str, str] | None = None,
                 max_pending_bytes: int = 1 << 30, loaders: int = 2, read_ahead: int = 4) -> None:
        """``kv_store``: a networked L3 store's URL (``store_clients.py``), behind the local
        directory when there is one; ``disk_bytes`` then bounds what the tree indexes on L3."""
        self.transfer = transfer
        self.page_size = page_size
        self.shapes = transfer.shapes
        self.dtype = transfer.dtype
        self.device = transfer.device
        self.cuda = self.device.type == "cuda"
        self.host_codec = get_codec(host_codec, page_size=page_size)
        self.disk_codec = get_codec(disk_codec, page_size=page_size)
        use_host = host_bytes > 0
        use_disk = (disk_dir is not None or kv_store is not None) and disk_bytes > 0
        if use_host:
            check_codec(self.host_codec, self.shapes)
        if use_disk:
            check_codec(self.disk_codec, self.shapes)
        self.host_page_nbytes = page_nbytes(self.host_codec, self.shapes, self.dtype) if use_host else 0
        self.disk_page_nbytes = page_nbytes(self.disk_codec, self.shapes, self.dtype) if use_disk else 0
        self.host: HostStore | None = None
        host_pages = host_bytes // self.host_page_nbytes if use_host else 0
        if host_pages:
            self.host = HostStore(host_pages * self.host_page_nbytes, self.host_page_nbytes,
                                  pin_memory=self.cuda)
            host_pages = self.host.num_slots
        self.store: PageStore | None = None
        self.remote: RemoteStore | None = None
        disk_pages = 0
        self.namespace = f"{namespace}|codec={self.disk_codec.tag}"
        if use_disk:
            self.store, self.remote = open_l3_store(disk_dir, disk_bytes, self.namespace, kv_store,
                                                    kv_store_options or {}, disk_secret)
            disk_pages = disk_bytes // self.store.file_bytes(self.disk_page_nbytes)
        self.host_capacity = host_pages
        self.disk_capacity = disk_pages
        self.codec_tag = self.disk_codec.tag
        self.moved = dict.fromkeys(MOVES, 0)  # (only loads are counted here)
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._host_pending: dict[int, Future] = {}  # slot -> its latest write
        self._disk_pending: dict[str, Future] = {}  # key -> its write (done when on disk)
        self._pending_bytes = 0
        self._failed: deque[str] = deque()
        self._host_exec = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-l2-writer")
        self._disk_exec = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-l3-writer")
        self._promote_exec = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-l2-promoter")
        self._closed = False
        self.counters = dict.fromkeys(
            ["host_bytes_written", "host_bytes_read", "disk_bytes_written", "disk_bytes_read",
             "host_pages_written", "host_pages_read", "disk_pages_written", "disk_files_written",
             "disk_files_read", "disk_writes_dropped", "disk_write_errors"], 0)  # fmt: skip
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        # read_ahead: reader threads of a load (queue depth; checksums on all cores)
        self.loader = PageLoader(transfer, self.host_codec, self.disk_codec, self.host_page_nbytes,
                                 self.disk_page_nbytes, self.store, self._read_host,
                                 self._wait_written, self._side, loaders=loaders,
                                 readers=read_ahead, page_size=page_size)
        self._log = RateLimitedLog(log)
        _live.add(self)

    # ---------------------------------------------------------------- L2 slots
    def host_alloc(self, n: int) -> list[int] | None:
        if self.host is None or n > self.host.num_free:
            return None
        return [self.host.alloc() for _ in range(n)]  # type: ignore[misc]

    def host_free(self, slots: list[int]) -> None:
        assert self.host is not None
        for s in slots:
            self.host.free(s)

    # ---------------------------------------------------------------- capture
    def _capture(self, pages: list[int]) -> tuple[list[torch.Tensor], Any]:
        """Copy L1 pages out now (they are freed right after); an event marks the copy on CUDA."""
        data = self.transfer.read_pages(pages)
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        return data, ev

    def _encode_on_side(self, codec: Codec, data: list[torch.Tensor], ev: Any) -> torch.Tensor:
        """Encode captured pages (writer thread) into host rows (for files)."""
        if not self.cuda:
            return encode_pages(codec, data)
        with torch.cuda.stream(self._side):
            self._side.wait_event(ev)
            rows = encode_pages(codec, data).cpu()  # synchronous on the side stream only
        return rows

    # ---------------------------------------------------------------- L1 -> L2
    def device_to_host(self, pages: list[int], slots: list[int]) -> None:
        assert self.host is not None
        data, ev = self._capture(pages)
        fut = self._host_exec.submit(self._write_host, data, ev, slots)
        with self._lock:
            for s in slots:
                self._host_pending[s] = fut

    def _write_host(self, data: list[torch.Tensor], ev: Any, slots: list[int]) -> None:
        assert self.host is not None
        if self.cuda:  # encode on the device, then async copies into the pinned slots
            with torch.cuda.stream(self._side):
                self._side.wait_event(ev)
                rows = encode_pages(self.host_codec, data)
                for i, s in enumerate(slots):
                    self.host.write(s, rows[i], non_blocking=True)
            self._side.synchronize()
        else:
            rows = encode_pages(self.host_codec, data)
            self.host.write_rows(slots, rows)
        with self._lock:
            self.counters["host_bytes_written"] += rows.numel()
            self.counters["host_pages_written"] += len(slots)

    def _read_host(self, slots: list[int], wait: bool = True) -> torch.Tensor:
        """A copy of L2 slots as rows. ``wait``: first wait for the slots' pending writes (a
        loader: the slots belong to a locked node, so their latest write is this node's). The
        host writer itself reads with ``wait=False``: the FIFO order already put the slots'
        own writes before it, and a pending write there is a *later* reuse of a freed slot,
        queued behind it."""
        assert self.host is not None
        if wait:
            with self._lock:
                futs = {self._host_pending.get(s) for s in slots} - {None}
            for f in futs:
                f.result()
        rows = self.host.read_rows(slots) if wait else self.host.read_raw(slots, self.host_page_nbytes)
        with self._lock:
            for s in slots:
                f = self._host_pending.get(s)
                if f is not None and f.done():
                    del self._host_pending[s]
            self.counters["host_bytes_read"] += rows.numel()
            self.counters["host_pages_read"] += len(slots)
        return rows

    # ---------------------------------------------------------------- -> L3
    def _reserve_disk(self, keys: list[str], nbytes: int) -> Future | None:
        need = len(keys) * nbytes
        with self._lock:
            refused = self.store is None or self._closed
            full = not refused and self._pending_bytes + need > self.max_pending_bytes
            if refused or full:
                self.counters["disk_writes_dropped"] += len(keys)
            else:
                self._pending_bytes += need
                fut: Future = Future()
                for k in keys:
                    self._disk_pending[k] = fut
                return fut
        if full:
            self._log.warning("queue-full", "L3 writer queue full (%d MiB pending): %d pages not "
                              "written", self.max_pending_bytes >> 20, len(keys))
        return None

    def device_to_disk(self, pages: list[int], keys: list[str], ids: list[PageId]) -> bool:
        fut = self._reserve_disk(keys, self.disk_page_nbytes)
        if fut is None:
            return False
        data, ev = self._capture(pages)
        self._disk_exec.submit(self._write_disk, keys, ids, fut,
                               lambda: self._encode_on_side(self.disk_codec, data, ev),
                               self.disk_page_nbytes, self.page_size)
        return True

    def host_to_disk(self, slots: list[int], keys: list[str], ids: list[PageId]) -> bool:
        assert self.host is not None
        fut = self._reserve_disk(keys, self.disk_page_nbytes)
        if fut is None:
            return False
        # Read on the (FIFO) host writer: after the slots' own pending writes, before any
        # later write that reuses them once the caller frees them.
        rows_f = self._host_exec.submit(self._read_host_for_disk, slots)
        self._disk_exec.submit(self._write_disk, keys, ids, fut, rows_f.result,
                               self.disk_page_nbytes, self.page_size)
        return True

    def _read_host_for_disk(self, slots: list[int]) -> torch.Tensor:
        rows = self._read_host(slots, wait=False)
        if self.host_codec.tag == self.disk_codec.tag:
            return rows
        data = decode_pages(self.host_codec, rows, self.shapes, self.dtype)
        return encode_pages(self.disk_codec, data)

    def _write_disk(self, keys: list[str], ids: list[PageId], fut: Future, produce: Any,
                    nbytes: int, token_count: int, counter: str = "disk_pages_written") -> None:
        """Write the rows of ``produce()`` ([len(keys), nbytes] uint8) as the files ``keys``
        holding the pages ``ids``."""
        assert self.store is not None
        ok = [False] * len(keys)
        try:
            rows = produce().cpu().numpy()
            ok = self.store.put_many([(k, rows[i].tobytes(), token_count, ids[i])
                                      for i, k in enumerate(keys)])
        except Exception:  # noqa: BLE001 - a cache write must never take the engine down
            log.exception("L3 write of %d files failed", len(keys))
        with self._lock:
            self._pending_bytes -= len(keys) * nbytes
            for k, good in zip(keys, ok):
                if self._disk_pending.get(k) is fut:
                    del self._disk_pending[k]
                if good:
                    self.counters[counter] += 1
                    self.counters["disk_bytes_written"] += nbytes
                else:
                    self.counters["disk_write_errors"] += 1
                    self._failed.append(k)
        fut.set_result(None)

    def write_file(self, key: str, data: Callable[[], torch.Tensor], nbytes: int,
                   token_count: int, page: PageId) -> bool:
        """Write a file that is no tree page (a window snapshot): ``data()``, ``nbytes`` uint8
        made on the L3 writer thread, under the pages' back-pressure; False if refused."""
        fut = self._reserve_disk([key], nbytes)
        if fut is None:
            return False
        self._disk_exec.submit(self._write_disk, [key], [page], fut, lambda: data().reshape(1, -1),
                               nbytes, token_count, "disk_files_written")
        return True

    def read_file(self, key: str, nbytes: int, page: PageId) -> memoryview | None:
        """The payload of file ``key`` if it reads back intact, ``nbytes`` long and holding
        ``page``, else None. Synchronous (waits for the file's pending write)."""
        if self.store is None:
            return None
        b = self._disk_get(key, page, nbytes)
        if b is not None:
            with self._lock:
                self.counters["disk_files_read"] += 1
                self.counters["disk_bytes_read"] += nbytes
        return b

    def poll_failed_writes(self) -> list[str]:
        out = []
        while self._failed:
            out.append(self._failed.popleft())
        return out

    # ---------------------------------------------------------------- L3 -> L2
    def disk_to_host(self, keys: list[str], ids: list[PageId], slots: list[int]) -> Future:
        return self._promote_exec.submit(self._read_disk_to_host, keys, ids, slots)

    def _read_disk_to_host(self, keys: list[str], ids: list[PageId], slots: list[int]) -> bool:
        assert self.store is not None and self.host is not None
        rows = torch.empty(len(keys), self.disk_page_nbytes, dtype=torch.uint8)
        for i, (key, pid) in enumerate(zip(keys, ids)):
            self._wait_written(key)
            if not self.store.read_into(key, [memoryview(rows[i].numpy())], pid):
                return False
        if self.host_codec.tag != self.disk_codec.tag:
            rows = encode_pages(self.host_codec, decode_pages(self.disk_codec, rows, self.shapes,
                                                              self.dtype))
        self.host.write_rows(slots, rows)
        with self._lock:
            self.moved["disk->host"] += len(slots)
            self.counters["disk_bytes_read"] += len(keys) * self.disk_page_nbytes
        return True

    # ---------------------------------------------------------------- loads
    def disk_contains(self, key: str, indexed: bool = False) -> bool:
        if self.store is None:
            return False
        with self._lock:
            if key in self._disk_pending:
                return True
        return self.store.known(key) if indexed else self.store.contains(key)

    def start_load(self, job: LoadJob) -> None:
        self.loader.start(job)

    def stream_layers(self, job: LoadJob) -> bool:
        return self.loader.stream_layers(job)

    def _disk_get(self, key: str, page: PageId | None, nbytes: int | None = None
                  ) -> memoryview | None:
        """The payload of ``key`` if intact, holding ``page`` and ``nbytes`` (default: one
        page) long."""
        assert self.store is not None
        self._wait_written(key)
        b = self.store.get(key, view=True, expect=page)
        return b if b is not None and len(b) == (nbytes or self.disk_page_nbytes) else None

    def _wait_written(self, key: str) -> None:
        with self._lock:
            fut = self._disk_pending.get(key)
        if fut is not None:
            fut.result()  # written meanwhile (or failed: then the read misses)

    def writing(self, page_hashes: list[bytes]) -> bool:
        keys = [self.disk_key(h) for h in page_hashes]
        with self._lock:
            return any(k in self._disk_pending for k in keys)

    def wait_written(self, keys: list[str]) -> None:
        """Wait for the queued L3 writes of ``keys`` (any thread)."""
        for k in keys:
            self._wait_written(k)

    def publish(self, pages: list[int], keys: list[str], ids: list[PageId]
                ) -> Callable[[], list[bool]]:
        """Write L1 ``pages`` (files ``keys`` holding ``ids``) to the networked store, and
        wait for its acks: a prefill worker's hand-over (``server/pd.py``). The data is
        captured now (engine thread); the call returned encodes, puts and answers per page
        whether the store took it (any thread, blocking)."""
        assert self.remote is not None
        remote, data, ev = self.remote, *self._capture(pages)

        def put() -> list[bool]:
            rows = self._encode_on_side(self.disk_codec, data, ev).cpu().numpy()
            items = [(k, rows[i].tobytes(), self.page_size, ids[i]) for i, k in enumerate(keys)]
            step = PUBLISH_BATCH  # each batch is one store call, within its timeout
            return [ok for i in range(0, len(items), step)
                    for ok in remote.put_many(items[i : i + step])]
        return put

    def put_in_front(self, store: PageStore) -> None:
        """Read L3 through ``store``, which reads through to the current one (a decode
        worker's pulled pages: ``kv/transfer_import.py``)."""
        self.store = self.loader.store = store

    def wait(self, timeout: float | None = None) -> bool:
        return self.loader.wait(timeout)

    # ---------------------------------------------------------------- lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued L2 and L3 write (not loads) to land."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._host_exec.submit(lambda: None).result(timeout)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._disk_exec.submit(lambda: None).result(left)
        except Exception:  # noqa: BLE001 - timeout, or executors already shut down
            return False
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush pending writes, stop the threads. Idempotent."""
        if self._closed:
            return True
        ok = self.flush(timeout)
        with self._lock:
            self._closed = True
        for ex in (self._host_exec, self._disk_exec, self._promote_exec):
            ex.shutdown(wait=ok, cancel_futures=not ok)
        self.loader.close(wait=ok)
        if self.store is not None:
            self.store.close()
        _live.discard(self)
        return ok

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self.counters)
            pending = self._pending_bytes
        for k, v in self.loader.stats().items():  # bytes read: window files here, pages there
            c[k] = c.get(k, 0) + v
        out: dict[str, Any] = {**c, "disk_pending_bytes": pending, "pages_moved": dict(self.moved),
                               "host_codec": self.host_codec.tag, "disk_codec": self.disk_codec.tag,
                               "host_page_bytes": self.host_page_nbytes,
                               "disk_page_bytes": self.disk_page_nbytes}
        if self.host is not None:
            out["host"] = self.host.stats()
        if self.store is not None:
            out["disk"] = self.store.stats()
            out["disk_dir"] = self.store.where
        if self.remote is not None:
            out["remote"] = self.remote.stats()
            out["remote_available"] = self.remote.available()
        return out


_live: weakref.WeakSet[TierIO] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """An engine that was not shut down still gets its queued L3 writes to disk."""
    for io in list(_live):
        try:
            io.close(timeout=60)
        except Exception:  # noqa: BLE001
            pass
