"""L3 disk tier: one file per KV page in a directory that several processes may share.

Here: ``DiskStore``, the store's API (put / get / read_into / verify ...), its LRU index, its
counters and its logging. The directory's layout and the file operations on it (paths, scan,
atomic write, quarantine) are ``disk_dir.py``; the file format, and how a file is bound to the
page it holds (a tag over header and payload; the header names the chained page hash and a
digest of the token ids, checked against what the reader asked for), is ``disk_file.py``.

Safety rules, because this is a cache and the engine must keep serving:

* writes go to ``.<key>.<host>.<pid>.<tid>.tmp`` in the final directory, are fsynced, then
  ``os.replace``d: readers only ever open ``<key>.kv``, so a crashed writer (kill -9) leaves at
  most a temp file, which the next open removes: at once when its writer (same host, that pid)
  is dead, else once older than ``tmp_max_age_s``;
* every failure is a miss or a ``False``, never an exception. A write that fails is counted by
  cause (``write_errors_no_space``, ``_permission``, ``_other``) and logged, rate-limited;
* a bad file (damaged, another page's, unreadable) is counted and moved to ``<dir>/quarantine/``
  (deleted once that holds ``max_quarantine`` files) and dropped from the index, so the page,
  recomputed, is written again: the store heals. ``put`` always writes (it never trusts an
  existing file it has not read). A file of another namespace or format is a miss left in place;
* the capacity bound is kept with an in-memory LRU index built by one scan at open and updated on
  put/get/evict. Files other processes add are found on an index miss (one ``stat``), and evicting a
  file someone else already removed is fine. Each process enforces the bound over the files it
  knows about, so several writers can briefly overshoot it by what the others added.

The engine writes through ``TierIO``'s writer thread (``tier_io.py``), never on the decode loop.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

from ...log_limit import RateLimitedLog
from . import disk_dir
from .disk_dir import check_key, unlink_quiet
from .disk_file import BadFile, PageFormat, PageId

__all__ = ["DiskStore"]
from .page_store import PageStore

log = logging.getLogger(__name__)

_WRITE_ERRORS = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EACCES: "permission",
                 errno.EPERM: "permission", errno.EROFS: "permission"}


class DiskStore(PageStore):
    """Content-addressed page files, bound to their pages, with atomic writes and an LRU
    byte budget.

    ``namespace=None`` opens the directory for maintenance (``deepinfer cache verify|stats|clear``):
    files of every namespace are accepted and checked, nothing can be written. Mind that opening
    evicts down to ``capacity_bytes``: maintenance opens with an unbounded capacity. ``secret``
    makes every tag a keyed MAC (``disk_file.py``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: str | None,
        *,
        tmp_max_age_s: float = 600.0,
        max_quarantine: int = 256,
        touch_on_hit: bool = True,
        secret: bytes | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.where = self.path
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = namespace
        self.format = PageFormat(namespace, secret)
        self._log = RateLimitedLog(log)
        self.tmp_max_age_s = tmp_max_age_s
        self.max_quarantine = max_quarantine
        self.touch_on_hit = touch_on_hit  # mtime = recency, so the LRU order survives a restart
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, oldest first
        self._bytes = 0
        self._closed = False
        self._counters = dict.fromkeys(
            ["hits", "misses", "bytes_read", "bytes_written", "writes", "checksum_failures",
             "corrupt_files", "mismatched_files", "foreign_files", "write_errors",
             "write_errors_no_space", "write_errors_permission", "write_errors_other",
             "evictions", "rejected", "quarantined", "stale_tmp_removed"],
            0,
        )  # fmt: skip
        try:
            os.makedirs(self.path, exist_ok=True)
            self._scan()
        except OSError as e:  # degraded: every put fails, every get misses; the engine still serves
            log.warning("disk KV store at %s unavailable: %s", self.path, e)

    # ------------------------------------------------------------------ paths and scan

    def file_path(self, key: str) -> str:
        return disk_dir.page_path(self.path, key)

    def _scan(self) -> None:
        """Build the index once (oldest mtime first) and remove stale temp files."""
        found, stale = disk_dir.scan(self.path, self.tmp_max_age_s)
        with self._lock:
            self._counters["stale_tmp_removed"] += stale
            self._index = OrderedDict((k, size) for _, k, size in found)
            self._bytes = sum(self._index.values())
            self._evict_locked(0)

    def rescan(self) -> None:
        """Re-read the directory (e.g. after other processes wrote a lot). Not for the hot path."""
        try:
            self._scan()
        except OSError as e:
            log.warning("disk KV store: rescan of %s failed: %s", self.path, e)

    # ------------------------------------------------------------------ index helpers (hold lock)

    def _add_locked(self, key: str, size: int) -> None:
        if key in self._index:
            self._index.move_to_end(key)
            return
        self._index[key] = size
        self._bytes += size

    def _drop_locked(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _evict_locked(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.capacity_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._counters["evictions"] += 1
            unlink_quiet(self.file_path(key))  # already gone (another process evicted it) is fine

    def _read_checked(self, key: str, expect: PageId | None = None
                      ) -> tuple[dict, memoryview, int]:
        try:
            with open(self.file_path(key), "rb") as f:
                data = f.read()
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise BadFile("missing", "no file") from None
            raise BadFile("corrupt", f"unreadable: {e}") from None
        header, payload = self.format.parse(key, data, expect)
        return header, payload, len(data)

    _BAD_COUNTERS = {"checksum": "checksum_failures", "corrupt": "corrupt_files",
                     "mismatch": "mismatched_files", "foreign": "foreign_files"}

    def _reject(self, key: str, bad: BadFile, repair: bool = True) -> None:
        """Count a bad file and drop it from the index; unless it is merely foreign (valid for
        someone else) or ``repair`` is off, quarantine it, so the page gets written again."""
        with self._lock:
            if bad.kind in self._BAD_COUNTERS:
                self._counters[self._BAD_COUNTERS[bad.kind]] += 1
            self._drop_locked(key)  # a foreign file stays in place; our next put() replaces it
        if bad.kind not in ("missing", "foreign") and repair:
            self._log.warning("bad-file", "disk KV store: quarantining %s (%s)", key, bad)
            self._quarantine(key)

    def _quarantine(self, key: str) -> None:
        if disk_dir.quarantine(self.path, key, self.max_quarantine):
            with self._lock:
                self._counters["quarantined"] += 1

    # ------------------------------------------------------------------ public API

    def put(self, key: str, payload: bytes, token_count: int, page: PageId | None = None) -> bool:
        """Store a page atomically (replacing any file of that key: it may be a bad one). True
        if stored; False if it is larger than the whole store or on any OSError."""
        self._check_open()
        if self.namespace is None:
            raise RuntimeError("a DiskStore opened without a namespace (maintenance) cannot write")
        check_key(key)
        with self._lock:
            self._drop_locked(key)  # re-added below at its new size
        head = self.format.head(key, len(payload), token_count, page)
        tag = self.format.tag(head, payload)
        size = len(head) + len(payload) + len(tag)
        if size > self.capacity_bytes:
            with self._lock:
                self._counters["rejected"] += 1
            self._log.warning("too-large", "disk KV store: a %d-byte file does not fit the %d-byte "
                              "bound; not written (raise --disk-cache-gb)", size, self.capacity_bytes)
            return False
        with self._lock:
            self._evict_locked(size)
        try:
            disk_dir.write_atomic(self.file_path(key), key, (head, payload, tag))
        except OSError as e:
            cause = _WRITE_ERRORS.get(e.errno, "other")
            with self._lock:
                self._counters["write_errors"] += 1
                self._counters[f"write_errors_{cause}"] += 1
            self._log.warning(f"write-{cause}", "disk KV store: write to %s failed (%s): %s",
                              self.path, cause, e)
            return False
        with self._lock:
            self._add_locked(key, size)
            self._counters["writes"] += 1
            self._counters["bytes_written"] += size
        return True

    def file_bytes(self, payload_len: int) -> int:
        """Size of the file of a tree page of ``payload_len`` bytes (for capacity in pages)."""
        return len(self.format.head("0" * 32, payload_len, 10**6, PageId(b"\0" * 16, b"\0" * 16))) \
            + len(self.format.tag(b"")) + payload_len

    def get(self, key: str, view: bool = False, expect: PageId | None = None
            ) -> bytes | memoryview | None:
        """Payload bytes if present, intact and (given ``expect``) the page asked for, else None
        (bad files are counted and quarantined). ``view``: a memoryview, not a copy."""
        self._check_open()
        check_key(key)
        try:
            _, payload, size = self._read_checked(key, expect)
        except BadFile as bad:
            self._miss(key, bad)
            return None
        self.count_hits([(key, size)], len(payload))
        self._touch(self.file_path(key))
        return payload if view else bytes(payload)

    def read_into(self, key: str, dest: Sequence[memoryview], expect: PageId | None = None) -> bool:
        """Like ``get``, but the payload lands in the caller's buffers ``dest`` (e.g. the L1
        page it is a copy of) and is checked there, with no intermediate copy. False (and
        ``dest`` garbage) if absent, bad, another page's or not exactly ``dest``'s size."""
        fd = self.open_page(key)
        if fd is None:
            return False
        try:
            size, payload_len = self.format.read_into(fd, key, dest, expect)
        except (BadFile, OSError) as e:
            return self.close_page(key, fd, e)
        return self.close_page(key, fd, None, size, payload_len)

    def open_page(self, key: str) -> int | None:
        """An open file of ``key`` for a read in pieces (``layer_stream.py``; end it with
        ``close_page``), or None: a counted miss."""
        self._check_open()
        check_key(key)
        try:
            return os.open(self.file_path(key), os.O_RDONLY)
        except OSError as e:
            self._miss(key, BadFile("missing" if e.errno in (errno.ENOENT, errno.ENOTDIR)
                                    else "corrupt", str(e)))
            return None

    def close_page(self, key: str, fd: int, error: BadFile | OSError | None, size: int = 0,
                   payload_len: int = 0) -> bool:
        """End a read of ``open_page``: a hit of a ``size``-byte file, or the miss ``error``
        (the file quarantined, as any bad file). -> whether it was a hit."""
        try:
            if error is None:
                self._touch(fd)
        finally:
            os.close(fd)
        if error is not None:
            self._miss(key, error if isinstance(error, BadFile) else BadFile("corrupt", f"unreadable: {error}"))
            return False
        self.count_hits([(key, size)], payload_len)
        return True

    def _miss(self, key: str, bad: BadFile) -> None:
        with self._lock:
            self._counters["misses"] += 1
        self._reject(key, bad)

    def count_hits(self, files: Sequence[tuple[str, int]], payload_len: int) -> None:
        """Hits of files (key, size) read and checked (here, or by ``batch_reads.py``)."""
        with self._lock:
            for key, size in files:
                self._add_locked(key, size)  # also adopts files written by other processes
            self._counters["hits"] += len(files)
            self._counters["bytes_read"] += len(files) * payload_len

    def _touch(self, file: int | str) -> None:
        """mtime = now (recency, for the LRU order after a restart), if ``touch_on_hit``."""
        if self.touch_on_hit:
            try:
                os.utime(file)
            except OSError:
                pass

    def contains(self, key: str) -> bool:
        """Cheap presence check: one stat, no read. A True can still turn into a get() miss."""
        self._check_open()
        check_key(key)
        try:
            size = os.stat(self.file_path(key)).st_size
        except OSError:
            with self._lock:
                self._drop_locked(key)  # evicted by another process
            return False
        with self._lock:
            if key not in self._index:
                self._add_locked(key, size)
        return True

    def resident(self, key: str) -> bool:
        """Whether page ``key``'s file is in the OS page cache (``disk_dir.in_page_cache``)."""
        return disk_dir.in_page_cache(self.file_path(key))

    def known(self, key: str) -> bool:
        """Index-only presence check, no system call: files this process wrote, found at open or
        has read since (not those other processes added meanwhile). For scans on the hot path."""
        with self._lock:
            return key in self._index

    def verify(self, repair: bool = False) -> dict[str, int]:
        """Full check of every file (``deepinfer cache verify``): format, tag over header and
        payload, namespace. ``repair``: quarantine the bad files and remove dead writers' temp
        files too (a report only, otherwise)."""
        self._check_open()
        report = {"checked": 0, "ok": 0, "corrupt": 0, "checksum_failures": 0, "foreign": 0,
                  "bytes": 0, "repaired": 0}
        try:
            dirs = disk_dir.fanout_dirs(self.path)
        except OSError:
            return report
        for d in dirs:
            for key in disk_dir.page_keys(d.path):
                try:
                    _, _, size = self._read_checked(key)
                except BadFile as bad:
                    if bad.kind == "missing":
                        continue
                    report["checked"] += 1
                    report[{"checksum": "checksum_failures", "corrupt": "corrupt"}.get(bad.kind, "foreign")] += 1
                    self._reject(key, bad, repair)
                    report["repaired"] += repair and bad.kind != "foreign"
                    continue
                report["checked"] += 1
                report["ok"] += 1
                report["bytes"] += size
                with self._lock:
                    if key not in self._index:
                        self._add_locked(key, size)
        if repair:
            self.rescan()  # removes dead writers' temp files
        return report

    def clear(self) -> None:
        """Delete every page file and the quarantine (other writers' fresh temp files are left)."""
        self._check_open()
        with self._lock:
            self._index.clear()
            self._bytes = 0
        disk_dir.clear(self.path)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._index), "bytes": self._bytes,
                    "capacity_bytes": self.capacity_bytes, **self._counters}  # fmt: skip

    def close(self) -> None:
        """Idempotent. Writes are durable as they complete, so nothing is left to flush here."""
        self._closed = True

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._index)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DiskStore is closed")
