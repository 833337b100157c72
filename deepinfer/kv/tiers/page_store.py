"""The storage interface under L3: encoded page bytes by key (``disk_key``: chained page hash
and disk codec tag).

``TierIO`` reads and writes L3 only through a ``PageStore``. Two kinds implement it:
``DiskStore`` (a directory, ``disk_store.py``) and ``RemoteStore`` (a networked key-value store,
``remote_store.py``); ``LayeredStore`` there puts a local directory in front of a remote one.
Writes come in batches (``put_many``: a writer's run of pages, one round trip on a networked
store); reads one key at a time, since the loaders keep several in flight.

Contract: a failure is a miss or a ``False``, never an exception, and a payload returned is one
whose checksum held (the bytes a store keeps are ``disk_file.py``'s, header and checksum
included).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .disk_file import PageId

PageItem = tuple[str, bytes, int, PageId | None]  # key, payload, token count, the page it is
# where a page read came from: this machine's tiers, a networked store shared by engines, or a
# prefill worker that sent it straight (``kv/transfer_import.py``); hits are reported per origin
LOCAL, STORE, PREFILL_WORKER = "local", "store", "prefill_worker"


class PageStore(ABC):
    """Encoded pages by key. ``where``: the directory or URL, for stats and logs."""

    where: str
    origin = LOCAL  # where this store's pages come from

    def last_read_origin(self) -> str:
        """Where this thread's last successful ``read_into`` came from."""
        return self.origin

    @abstractmethod
    def put(self, key: str, payload: bytes, token_count: int, page: PageId | None = None) -> bool:
        """Store a page; True if stored (or already present)."""

    @abstractmethod
    def get(self, key: str, view: bool = False, expect: PageId | None = None
            ) -> bytes | memoryview | None:
        """The payload if present, intact and (``expect``) that page, else None (a counted miss)."""

    @abstractmethod
    def file_bytes(self, payload_len: int) -> int:
        """Bytes one stored page of ``payload_len`` takes (header and tag included)."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Presence check without reading the page (a True can still turn into a miss)."""

    @abstractmethod
    def known(self, key: str) -> bool:
        """Presence in this process's own index only: no I/O (for scans on the hot path)."""

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def close(self) -> None: ...

    def resident(self, key: str) -> bool:
        """Whether reading page ``key`` is memory work, not device (or network) work: the
        loader then runs no more reader threads than cores. Not known here: False."""
        return False

    def read_into(self, key: str, dest: list[memoryview], expect: PageId | None = None) -> bool:
        """Like ``get``, the payload into the caller's buffers ``dest`` (here a copy; the
        directory store reads straight into them). False if absent, bad or not ``dest``'s size."""
        payload = self.get(key, view=True, expect=expect)
        return payload is not None and copy_payload(payload, dest)

    def put_many(self, items: list[PageItem]) -> list[bool]:
        """Store pages; per page, True if stored. One round trip on a networked store, one
        file after another on a directory."""
        return [self.put(*item) for item in items]


def copy_payload(payload: bytes | memoryview, dest: list[memoryview]) -> bool:
    """``payload`` into the buffers ``dest``, filled in order; False if the sizes differ."""
    flat = [d.cast("B") if d.ndim != 1 or d.format != "B" else d for d in dest]
    if len(payload) != sum(d.nbytes for d in flat):
        return False
    off = 0
    for d in flat:
        d[:] = payload[off : off + d.nbytes]
        off += d.nbytes
    return True
