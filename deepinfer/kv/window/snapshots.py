"""Window snapshots: a ring's contents before a page boundary, in host memory and on L3.

With a disk tier, every snapshot taken is also written to the L3 directory (``SnapshotFiles``:
the disk writer thread, under the pages' back-pressure; atomic files with a namespaced header and
a checksum), so a restarted engine, or another one sharing the directory, that loads a prefix's
pages from L3 gets its window too instead of replaying ``sum(W_l - 1)`` tokens. The file's key
hashes the boundary's page hash with a tag naming the window layout, dtype and codec, so it never
meets a page file or another layout's snapshot. A lookup that finds no snapshot in memory at a
boundary asks the store's in-memory index (no system call; so files another process wrote after
this one opened the directory are not seen) and reads the file *synchronously* at admission,
where the hit's length, and so the boundary wanted, is first known (the pages' load before it is
asynchronous): one file of about W tokens of the sliding layers, once per prefix and restart (it
is then kept in memory), against recomputing every layer over ``sum(W_l - 1)`` tokens. A bad,
truncated or foreign file is a counted miss (``window_snapshot_disk_failures``): the lookup goes
on to shallower boundaries, then replays. Snapshot files share the store's byte budget and LRU
with the page files and, like those, outlive the tree's records.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hashing import disk_key
from ..tiers.backend import TierBackend
from ..tiers.codecs import get_codec
from ..tiers.page_bytes import decode_pages, encode_pages, page_nbytes
from ..tiers.disk_file import page_id


@dataclass(eq=False)
class WindowSnapshot:
    """Ring contents of absolute pages [first_page, first_page + num_pages) of every owned
    window buffer, on the host."""

    first_page: int
    data: list[torch.Tensor]  # per owned buffer: [num_pages, page_size, ...]

    @property
    def num_pages(self) -> int:
        return self.data[0].shape[0] if self.data else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


class WindowSnapshotStore:
    """Snapshots by page hash, least recently used dropped first to stay under ``capacity``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, WindowSnapshot] = OrderedDict()
        self.stored = 0
        self.evicted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def get(self, key: bytes) -> WindowSnapshot | None:
        snap = self._items.get(key)
        if snap is not None:
            self._items.move_to_end(key)
        return snap

    def put(self, key: bytes, snap: WindowSnapshot) -> bool:
        size = snap.nbytes
        if size > self.capacity or key in self._items:
            return False
        while self.bytes + size > self.capacity:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        self._items[key] = snap
        self.bytes += size
        self.stored += 1
        return True

    def drop(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            snap = self._items.pop(k, None)
            if snap is not None:
                self.bytes -= snap.nbytes
                self.dropped += 1


LOSSLESS = get_codec("lossless")


@dataclass
class SnapshotFiles:
    """Window snapshots as L3 files, next to the page files (see the module docstring).

    Always lossless, whatever the disk codec: a restored window is the state every later token
    of the sliding layers builds on, and the snapshots taken from it later count as exact, so a
    lossy copy would compound its error over turns and restarts (the reason a lossy replay never
    leaves a snapshot); and one snapshot saves recomputing ``sum(W_l - 1)`` tokens, worth its
    bytes."""

    backend: TierBackend  # the tiers' (``TierIO`` in the engine)
    shapes: list[tuple[int, ...]]  # one page of each owned window buffer
    dtype: torch.dtype
    tag: str  # hashed into every key: no collision with page files or another window layout

    @staticmethod
    def create(backend: TierBackend, owners: tuple[int, ...], shapes: list[tuple[int, ...]],
               dtype: torch.dtype) -> SnapshotFiles:
        """Snapshot files of the window buffers of ``owners`` (one page of each: ``shapes``).

        The tag also names the disk codec, which is part of the store's namespace: engines
        with different disk codecs keep apart files rather than taking each other's as foreign."""
        tag = (f"window-snapshot|{owners}|{shapes}|{dtype}|{LOSSLESS.tag}"
               f"|store={backend.codec_tag}")
        return SnapshotFiles(backend, shapes, dtype, tag)

    def key(self, page_hash: bytes) -> str:
        return disk_key(page_hash, self.tag)

    def nbytes(self, num_pages: int) -> int:
        return num_pages * page_nbytes(LOSSLESS, self.shapes, self.dtype)

    def has(self, page_hash: bytes) -> bool:
        """Cheap: the store's in-memory index only."""
        return self.backend.disk_contains(self.key(page_hash), indexed=True)

    def write(self, page_hash: bytes, snap: WindowSnapshot, boundary: int) -> bool:
        """Queue ``snap`` (the window before ``boundary``) for the L3 writer unless already there."""
        if self.has(page_hash):
            return False
        return self.backend.write_file(self.key(page_hash), lambda: encode_pages(LOSSLESS, snap.data),
                                       self.nbytes(snap.num_pages), boundary, page_id(page_hash))

    def read(self, page_hash: bytes, first_page: int, num_pages: int) -> WindowSnapshot | None:
        """The snapshot of pages [first_page, first_page + num_pages), None if its file is absent,
        bad or of another size."""
        raw = self.backend.read_file(self.key(page_hash), self.nbytes(num_pages), page_id(page_hash))
        if raw is None:
            return None
        rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(num_pages, -1)
        return WindowSnapshot(first_page, decode_pages(LOSSLESS, rows, self.shapes, self.dtype))

