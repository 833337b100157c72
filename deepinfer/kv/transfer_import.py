"""A decode worker's side of the direct route (``transfer.py``): a prefill worker's pages read
into this worker's registered arena, then served to the tier-load path like L3 pages.

``PagePuller.manifest`` reads a ``TransferDescriptor``'s manifest (each page's chained hash
and checksum) and checks it is the one described; the caller counts the leading pages its tree
already holds (the request will not read those: earlier turns of a conversation), and
``PagePuller.pull`` reads the pages after those with one transfer-engine read into a range of
the arena, each page's checksum checked against the manifest's (else the run is dropped: it is
not what the prefill worker exported). ``StagedPages.stage`` then indexes them.

``StagedPages`` is a ``PageStore`` put in front of the L3 store (``TierIO.put_in_front``), so
the request's lookup finds the staged pages as L3 pages and the loaders read them as they read
a store's: each page checked on its way into L1 (its checksum, and that it is the page asked
for); a bad one is a counted miss (the store is tried next, else the request computes it).
Its reads report the origin ``prefill_worker`` (``usage...cached_tokens_from_prefill_worker``).
A staged page is wanted once per run that staged it (concurrent requests sharing a prefix read
the first run's copy); a run's range is freed once none of its pages is wanted any more (read,
or found bad), or when its TTL runs out (a load cut short, a request that went away).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

import xxhash

from .hashing import HASH_BYTES
from .tiers.disk_file import PREFIX, BadFile, PageFormat, PageId
from .tiers.page_store import PREFILL_WORKER, PageItem, PageStore, copy_payload
from .transfer import Arena, TransferDescriptor, TransferError, TransferLink

log = logging.getLogger(__name__)
IMPORT_COUNTERS = ("pulls", "pages_pulled", "bytes_pulled", "pages_held", "pages_read",
                   "checksum_failures", "bad_runs", "expired_pages")


@dataclass(frozen=True)
class Manifest:
    """A transfer's pages in order: their chained hashes and checksum tags."""

    hashes: list[bytes]
    tags: list[bytes]


@dataclass
class PulledRun:
    """Pages read into the arena at ``offset``: each page's key and chained hash (from its
    header, not yet checked: the loaders check each page when they read it)."""

    offset: int
    nbytes: int  # 0: nothing pulled (the tree held every page)
    page_bytes: int
    keys: list[str]
    hashes: list[bytes]
    seconds: float  # the reads and the checks
    held: int = 0  # the transfer's leading pages not pulled: the tree held them
    serves: set[str] = field(default_factory=set)  # staged pages it holds, still wanted
    expires: float = 0.0


class _LastRead(threading.local):
    origin = PREFILL_WORKER


class StagedPages(PageStore):
    """Pulled pages by key, in front of ``inner`` (the L3 store); see the module doc."""

    origin = PREFILL_WORKER

    def __init__(self, inner: PageStore, fmt: PageFormat, arena: Arena, ttl_s: float) -> None:
        self.inner = inner
        self.where = inner.where
        self.format = fmt
        self.arena = arena
        self.ttl_s = ttl_s
        self.tag_bytes = len(fmt.tag(b""))
        self._pages: dict[str, tuple[PulledRun, int]] = {}  # key -> (the run holding it, offset)
        self._wanted: dict[str, int] = {}  # key -> reads still expected (one per staging run)
        self._runs: dict[int, PulledRun] = {}  # staged runs by offset
        self._lock = threading.Lock()
        self._read = _LastRead()
        self.counters = dict.fromkeys(IMPORT_COUNTERS, 0)

    # ------------------------------------------------------------------ staging
    def read_manifest(self, offset: int, d: TransferDescriptor) -> Manifest:
        """The manifest ``d`` describes, read to ``offset``. TransferError if its digest is not
        ``d``'s (the range was freed and reused, or the descriptor is wrong)."""
        entry = HASH_BYTES + self.tag_bytes
        raw = bytes(self.arena.view(offset, d.pages * entry))
        if xxhash.xxh3_128(raw).hexdigest() != d.tags:
            self._count("bad_runs")
            raise TransferError("the pages read are not the ones described (checksums differ)")
        return Manifest([raw[i : i + HASH_BYTES] for i in range(0, len(raw), entry)],
                        [raw[i + HASH_BYTES : i + entry] for i in range(0, len(raw), entry)])

    def check(self, offset: int, n: int, page_bytes: int, tags: list[bytes]
              ) -> tuple[list[str], list[bytes]]:
        """The keys and hashes of the ``n`` pages read to ``offset`` (the leading pages whose
        header names them). TransferError if their checksums are not ``tags``."""
        for i in range(n):
            end = offset + (i + 1) * page_bytes
            if bytes(self.arena.view(end - self.tag_bytes, self.tag_bytes)) != tags[i]:
                self._count("bad_runs")
                raise TransferError("the pages read are not the ones described "
                                    "(checksums differ)")
        keys, hashes = [], []
        for i in range(n):
            view = self.arena.view(offset + i * page_bytes, page_bytes)
            try:
                _, _, hlen = PREFIX.unpack_from(view)
                header = json.loads(bytes(view[PREFIX.size : PREFIX.size + hlen]))
                key, page = header["key"], bytes.fromhex(header["page"])
            except (ValueError, TypeError, KeyError):  # struct.error is a ValueError
                break  # a damaged header: the pages from here on are computed
            if not isinstance(key, str):
                break
            keys.append(key)
            hashes.append(page)
        return keys, hashes

    def stage(self, run: PulledRun) -> int:
        """Serve ``run``'s pages: -> pages staged. A run that holds none of them (none pulled,
        or a concurrent run of the same prefix holds them all) is freed at once."""
        with self._lock:
            for i, key in enumerate(run.keys):
                self._wanted[key] = self._wanted.get(key, 0) + 1
                if key not in self._pages:  # else a concurrent run of the same prefix holds it
                    self._pages[key] = (run, run.offset + i * run.page_bytes)
                    run.serves.add(key)
            run.expires = time.monotonic() + self.ttl_s
            c = self.counters
            c["pulls"] += 1
            c["pages_pulled"] += len(run.keys)
            c["bytes_pulled"] += run.nbytes
            c["pages_held"] += run.held
            if run.serves:
                self._runs[run.offset] = run
                return len(run.keys)
        if run.nbytes:
            self.arena.free(run.offset, run.nbytes)
        return len(run.keys)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _served(self, run: PulledRun, key: str, good: bool) -> None:
        """``key`` of ``run`` was read (``good``) or found bad (then nobody gets it): free
        the run once it holds no wanted page."""
        with self._lock:
            left = self._wanted.get(key, 0) - 1 if good else 0
            if left > 0:
                self._wanted[key] = left
                return
            self._wanted.pop(key, None)
            self._pages.pop(key, None)
            run.serves.discard(key)
            if run.serves or self._runs.get(run.offset) is not run:
                return
            del self._runs[run.offset]
        self.arena.free(run.offset, run.nbytes)

    def sweep(self) -> None:
        """Drop the runs whose TTL ran out."""
        now = time.monotonic()
        with self._lock:
            old = [r for r in self._runs.values() if r.expires <= now]
            for r in old:
                del self._runs[r.offset]
                self.counters["expired_pages"] += len(r.serves)
                for key in r.serves:
                    self._pages.pop(key, None)
                    self._wanted.pop(key, None)
        for r in old:
            self.arena.free(r.offset, r.nbytes)

    # ------------------------------------------------------------------ PageStore
    def read_into(self, key: str, dest: list[memoryview], expect: PageId | None = None) -> bool:
        with self._lock:
            got = self._pages.get(key)
        if got is not None:
            run, off = got
            try:
                _, payload = self.format.parse(key, self.arena.view(off, run.page_bytes), expect)
                if not copy_payload(payload, dest):
                    raise BadFile("foreign", "payload size differs from the pool's pages")
            except BadFile as bad:
                log.warning("page %s from the prefill worker unusable (%s): a miss", key, bad)
                self._count("checksum_failures")
                self._served(run, key, good=False)
            else:
                self._count("pages_read")
                self._served(run, key, good=True)
                self._read.origin = PREFILL_WORKER
                return True
        ok = self.inner.read_into(key, dest, expect)  # the store may hold it (a good copy)
        self._read.origin = self.inner.last_read_origin()
        return ok

    def last_read_origin(self) -> str:
        return self._read.origin

    def get(self, key: str, view: bool = False, expect: PageId | None = None
            ) -> bytes | memoryview | None:
        return self.inner.get(key, view, expect)  # pages are read by ``read_into`` alone

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._pages:
                return True
        return self.inner.contains(key)

    def known(self, key: str) -> bool:
        with self._lock:
            if key in self._pages:
                return True
        return self.inner.known(key)

    def put(self, key: str, payload: bytes, token_count: int, page: PageId | None = None) -> bool:
        return self.inner.put(key, payload, token_count, page)

    def put_many(self, items: list[PageItem]) -> list[bool]:
        return self.inner.put_many(items)

    def file_bytes(self, payload_len: int) -> int:
        return self.inner.file_bytes(payload_len)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def staged_stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "staged_pages": len(self._pages)}

    def close(self) -> None:
        self.inner.close()


class PagePuller:
    """Reads descriptors' pages into ``staged``'s arena over ``link``."""

    def __init__(self, link: TransferLink, staged: StagedPages) -> None:
        self.link = link
        self.staged = staged
        self.arena = staged.arena

    def manifest(self, d: TransferDescriptor) -> Manifest:
        """Blocking: ``d``'s manifest, read and checked (TransferError if it cannot be read or
        is not the one described)."""
        nbytes = d.pages * (HASH_BYTES + self.staged.tag_bytes)
        self.staged.sweep()
        off = self.arena.alloc(nbytes) if nbytes else None
        if off is None:
            raise TransferError(f"no room for {nbytes} bytes in the staging buffer"
                                if nbytes else "no pages described")
        try:
            self.link.read(d.session, self.arena.address + off, d.manifest_address, nbytes)
            return self.staged.read_manifest(off, d)
        finally:
            self.arena.free(off, nbytes)

    def pull(self, d: TransferDescriptor, manifest: Manifest, held: int,
             abandoned: threading.Event) -> PulledRun:
        """Blocking: ``d``'s pages after the first ``held`` (this worker's tree has those)
        read and checked against ``manifest``, not staged yet (``StagedPages.stage``).
        TransferError if they cannot be read or are not the ones described, or if the caller
        gave up meanwhile (``abandoned``)."""
        t0 = time.perf_counter()
        if abandoned.is_set():
            raise TransferError("abandoned")
        n = d.pages - held
        if n <= 0:
            return PulledRun(0, 0, d.page_bytes, [], [], time.perf_counter() - t0, held=d.pages)
        nbytes = n * d.page_bytes
        self.staged.sweep()
        off = self.arena.alloc(nbytes)
        if off is None:
            raise TransferError(f"no room for {nbytes} bytes in the staging buffer")
        try:
            self.link.read(d.session, self.arena.address + off,
                           d.address + held * d.page_bytes, nbytes)
            keys, hashes = self.staged.check(off, n, d.page_bytes, manifest.tags[held:])
            if abandoned.is_set():
                raise TransferError("abandoned")
        except BaseException:
            self.arena.free(off, nbytes)
            raise
        return PulledRun(off, nbytes, d.page_bytes, keys, hashes, time.perf_counter() - t0,
                         held=held)
