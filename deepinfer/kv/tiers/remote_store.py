"""L3 in a networked key-value store shared by engine processes (Mooncake Store, Redis/Valkey).

``RemoteStore`` keeps the same bytes as an L3 file (``disk_file.py``: namespace, key, checksum,
payload) under the same key, so a page is checked on every read, whoever wrote it: a missing,
foreign or bad page is a counted miss, never wrong output. The wire calls sit behind ``KVClient``
(batch exists / get / put of byte strings: ``store_clients.py``).

Calls run on the store's own threads and are waited for ``timeout_s`` at most. A store that
fails (down, timed out, refusing) is marked unavailable: every call is then an immediate miss
or refused write (counted ``unavailable``), and a background probe every ``retry_s`` finds it
back, so a dead store costs one timeout, not one per page, and serving continues from the local
tiers. One warning is logged when it goes away, one line when it comes back.

``LayeredStore`` puts a local directory (``DiskStore``) in front of a remote store: writes go to
both, reads try the directory first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from .disk_file import BadFile, PageFormat, PageId
from .disk_store import DiskStore
from .page_store import LOCAL, STORE, PageItem, PageStore

log = logging.getLogger(__name__)
T = TypeVar("T")
# RemoteStore's counters (LLMEngine.stats() reports them as cache_remote_<name>_total)
REMOTE_COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "writes", "checksum_failures",
                   "corrupt_files", "foreign_files", "mismatched_files", "write_errors", "unavailable",
                   "outages")


class KVClient(ABC):
    """Wire calls of one networked store. Any failure raises (``RemoteStore`` catches it)."""

    url: str

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: list[str]) -> list[bytes | None]:
        """The stored bytes per key, None where absent."""

    @abstractmethod
    def put(self, keys: list[str], values: list[bytes]) -> None:
        """Store (or replace) the values."""

    @abstractmethod
    def close(self) -> None: ...


class RemoteStore(PageStore):
    """Checksummed page bytes in a ``KVClient``'s store. ``max_known``: how many keys this
    process remembers having written or read (``known``)."""

    origin = STORE

    def __init__(self, client: KVClient, namespace: str, *, secret: bytes | None = None,
                 retry_s: float = 5.0, timeout_s: float = 2.0, max_known: int = 1 << 20,
                 threads: int = 4) -> None:
        self.client = client
        self.where = client.url
        self.namespace = namespace
        self.format = PageFormat(namespace, secret)  # the L3 files' format, tag and binding
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self.max_known = max_known
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._down = False
        self._retry_at = 0.0  # when a down store is probed again
        self._probing = False
        self._closed = False
        self._counters = dict.fromkeys(REMOTE_COUNTERS, 0)
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        for i in range(threads):  # daemons: a call hung in a dead store never holds up exit
            threading.Thread(target=self._serve_calls, name=f"deepinfer-kv-store-{i}",
                             daemon=True).start()

    # ------------------------------------------------------------------ availability

    def _serve_calls(self) -> None:
        while True:
            fn, fut = self._calls.get()
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _submit(self, fn: Callable[[], T]) -> Future:
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut

    def _call(self, what: str, n: int, fn: Callable[[], T]) -> T | None:
        """``fn()`` on a store thread, waited for up to ``timeout_s``; None (counting ``n``
        unavailable) if it fails or while the store is down. A down store is probed in the
        background every ``retry_s``: callers never wait on it."""
        with self._lock:
            if self._closed:
                return None
            if self._down:
                self._counters["unavailable"] += n
                if not self._probing and time.monotonic() >= self._retry_at:
                    self._probing = True
                    self._submit(self._probe)
                return None
        try:
            return self._submit(fn).result(timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a cache store that fails must never fail serving
            with self._lock:
                self._counters["unavailable"] += n
                if not self._down:
                    self._down = True
                    self._retry_at = time.monotonic() + self.retry_s
                    self._counters["outages"] += 1
                    log.warning("KV store %s unavailable (%s: %s); serving from local tiers, "
                                "retrying every %.0f s", self.where, what, e or type(e).__name__,
                                self.retry_s)
            return None

    def _probe(self) -> None:
        try:
            self.client.exists(["deepinfer-probe"])
            back = True
        except Exception:  # noqa: BLE001 - still down
            back = False
        with self._lock:
            self._probing = False
            self._down = not back
            self._retry_at = time.monotonic() + self.retry_s
        if back:
            log.warning("KV store %s is back", self.where)

    def available(self) -> bool:
        with self._lock:
            return not self._down

    def _remember(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > self.max_known:
                self._known.popitem(last=False)

    # ------------------------------------------------------------------ PageStore

    def put(self, key: str, payload: bytes, token_count: int, page: PageId | None = None) -> bool:
        return self.put_many([(key, payload, token_count, page)])[0]

    def put_many(self, items: list[PageItem]) -> list[bool]:
        keys = [k for k, _, _, _ in items]
        values = []
        for k, p, n, page in items:
            head = self.format.head(k, len(p), n, page)
            values.append(head + bytes(p) + self.format.tag(head, p))

        def send() -> bool:
            self.client.put(keys, values)
            return True

        ok = self._call("put", len(keys), send) is not None
        with self._lock:
            if ok:
                self._counters["writes"] += len(keys)
                self._counters["bytes_written"] += sum(map(len, values))
            else:
                self._counters["write_errors"] += len(keys)
        if ok:
            self._remember(keys)
        return [ok] * len(keys)

    def file_bytes(self, payload_len: int) -> int:
        return len(self.format.head("0" * 32, payload_len, 10**6, PageId(b"\0" * 16, b"\0" * 16))) \
            + len(self.format.tag(b"")) + payload_len

    def get(self, key: str, view: bool = False, expect: PageId | None = None
            ) -> bytes | memoryview | None:
        got = self._call("get", 1, lambda: self.client.get([key]))
        data = got[0] if got else None
        if data is None:
            with self._lock:
                self._counters["misses"] += 1
            return None
        try:
            _, payload = self.format.parse(key, data, expect)
        except BadFile as bad:
            name = {"checksum": "checksum_failures", "foreign": "foreign_files",
                    "mismatch": "mismatched_files"}.get(bad.kind, "corrupt_files")
            log.warning("KV store %s: page %s unusable (%s), counted as a miss", self.where, key, bad)
            with self._lock:
                self._counters["misses"] += 1
                self._counters[name] += 1
                self._known.pop(key, None)
            return None
        with self._lock:
            self._counters["hits"] += 1
            self._counters["bytes_read"] += len(payload)
        self._remember([key])
        return payload if view else bytes(payload)

    def contains(self, key: str) -> bool:
        found = self._call("exists", 1, lambda: self.client.exists([key]))
        if found and found[0]:
            self._remember([key])
            return True
        return False

    def put_record(self, key: str, payload: bytes) -> bool:
        """Store a small value that is no page (a chat reply record:
        ``server/shared_replies.py``) in the pages' format, so it is checked alike; it is not
        counted with the pages. True once the store acknowledged it."""
        head = self.format.head(key, len(payload), 0, None)
        value = head + payload + self.format.tag(head, payload)
        return self._call("put", 1, lambda: self.client.put([key], [value]) or True) is not None

    def get_record(self, key: str) -> bytes | None:
        """A value ``put_record`` stored, if present and intact."""
        got = self._call("get", 1, lambda: self.client.get([key]))
        if not got or got[0] is None:
            return None
        try:
            return bytes(self.format.parse(key, got[0])[1])
        except BadFile as bad:
            log.warning("KV store %s: record %s unusable (%s), ignored", self.where, key, bad)
            return None

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Presence of each key, in one round trip (all False while the store is down)."""
        if not keys:
            return []
        found = self._call("exists", len(keys), lambda: self.client.exists(keys))
        if not found:
            return [False] * len(keys)
        self._remember([k for k, f in zip(keys, found) if f])
        return [bool(f) for f in found]

    def known(self, key: str) -> bool:
        with self._lock:
            return key in self._known

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._known), **self._counters}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        fut = self._submit(self.client.close)
        try:
            fut.result(timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - closing a store that is already gone
            pass


class _LastRead(threading.local):
    origin = LOCAL  # per reader thread: where its last read came from


class LayeredStore(PageStore):
    """A local directory in front of a remote store: pages written to both, read from the
    directory first. ``stats()`` is the directory's; the remote keeps its own."""

    def __init__(self, local: DiskStore, remote: RemoteStore) -> None:
        self.local = local
        self.remote = remote
        self.where = f"{local.where} + {remote.where}"
        self._read = _LastRead()

    def put(self, key: str, payload: bytes, token_count: int, page: PageId | None = None) -> bool:
        return self.put_many([(key, payload, token_count, page)])[0]

    def put_many(self, items: list[PageItem]) -> list[bool]:
        here = self.local.put_many(items)
        there = self.remote.put_many(items)
        return [a or b for a, b in zip(here, there)]

    def file_bytes(self, payload_len: int) -> int:
        return max(self.local.file_bytes(payload_len), self.remote.file_bytes(payload_len))

    def get(self, key: str, view: bool = False, expect: PageId | None = None
            ) -> bytes | memoryview | None:
        if self.local.known(key) or self.local.contains(key):
            got = self.local.get(key, view, expect)
            if got is not None:
                return got
        return self.remote.get(key, view, expect)

    def read_into(self, key: str, dest: list[memoryview], expect: PageId | None = None) -> bool:
        self._read.origin = LOCAL
        if (self.local.known(key) or self.local.contains(key)) and self.local.read_into(key, dest, expect):
            return True
        ok = self.remote.read_into(key, dest, expect)
        self._read.origin = STORE if ok else LOCAL
        return ok

    def last_read_origin(self) -> str:
        return self._read.origin

    def contains(self, key: str) -> bool:
        return self.local.contains(key) or self.remote.contains(key)

    def known(self, key: str) -> bool:
        return self.local.known(key) or self.remote.known(key)

    def stats(self) -> dict[str, int]:
        return self.local.stats()

    def close(self) -> None:
        self.local.close()
        self.remote.close()
