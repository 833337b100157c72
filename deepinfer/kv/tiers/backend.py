"""The tier backend contract (``TierBackend``), the load job it fills (``LoadJob``), and
``CountingBackend``, which moves nothing: the capacity planner's and the policy tests'.

The tier manager (``policy.py``) decides what moves; a backend moves it. The engine's backend is
``TierIO`` (``tier_io.py``: codecs, pinned host slots, files, background threads).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hashing import disk_key
from ..radix import NUM_TIERS, TIER_NAMES, Node
from .disk_file import PageId
from .layer_stream import LayerLoads

DiskKey = str | bytes  # an L3 key (``disk_key``; the planner uses the page hash itself)
PageSource = tuple[int, int | DiskKey]  # (tier, L2 slot or L3 key) of a page to load
MOVES = ("device->host", "device->disk", "host->disk", "host->device", "disk->device",
         "disk->host")


@dataclass(eq=False)
class LoadJob:
    """Pages to bring back into L1: ``sources`` (tier, slot or key) in chain order, then the
    L3 keys in ``probe``, read until the first miss, each straight into its L1 page of ``dest``
    (allocated by the cache manager; ``dest`` may be shorter: then only that many load)."""

    sources: list[PageSource]
    probe: list[DiskKey] = field(default_factory=list)
    # the page each L3 file must hold (``disk_file.py``): per source (None for L2), per probe key
    source_ids: list[PageId | None] = field(default_factory=list)
    probe_ids: list[PageId] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    dest: list[int] = field(default_factory=list)
    # per layer, whether its KV is in place: a layer-wise load (``TierBackend.stream_layers``)
    layers: LayerLoads | None = None
    # set by the backend
    done: bool = False
    cancelled: bool = False
    num_loaded: int = 0  # leading pages of ``dest`` whose data is in place
    page_tiers: list[int] = field(default_factory=list)  # source tier of each loaded page
    page_origins: list[str] = field(default_factory=list)  # per loaded page: ``page_store.py``'s
    failed_at: int | None = None  # index of a source page that could not be read
    seconds: float = 0.0  # queued -> data in place
    seconds_by_tier: list[float] = field(default_factory=lambda: [0.0] * NUM_TIERS)  # reading
    bytes_by_tier: list[int] = field(default_factory=lambda: [0] * NUM_TIERS)  # read, encoded
    # set by the cache manager
    start: int = 0  # first page (pages before it are in L1)
    prefix_pages: list[int] = field(default_factory=list)  # their L1 page ids
    locked: Node | None = None
    source_nodes: list[Node] = field(default_factory=list)  # tree node of each source page

    def truncate(self, n: int) -> None:
        """Load at most ``n`` pages (L1 had no room for more)."""
        del self.sources[n:]
        del self.source_ids[n:]
        del self.source_nodes[n:]
        del self.probe[max(0, n - len(self.sources)) :]
        del self.probe_ids[max(0, n - len(self.sources)) :]


@dataclass
class LoadStats:
    """A request's loads from the lower tiers, for its output and the metrics: ``seconds`` from
    queueing the load to its data in L1, and per tier the seconds spent reading and decoding
    and the (encoded) bytes read."""

    seconds: float = 0.0
    seconds_by_tier: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)

    def add(self, job: LoadJob) -> None:
        self.seconds += job.seconds
        for t in range(1, NUM_TIERS):  # the lower tiers (L1 is never loaded from)
            name = TIER_NAMES[t]
            self.seconds_by_tier[name] = self.seconds_by_tier.get(name, 0.0) + job.seconds_by_tier[t]
            self.bytes_by_tier[name] = self.bytes_by_tier.get(name, 0) + job.bytes_by_tier[t]

    @property
    def gb_per_s(self) -> float:
        """Effective load throughput: bytes read over the whole wait (0 without a load)."""
        return sum(self.bytes_by_tier.values()) / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict[str, float | dict[str, float] | dict[str, int]]:
        """The tiers that were read from only (a response's ``usage.kv_load``)."""
        read = [t for t, n in self.bytes_by_tier.items() if n]
        return {"seconds": self.seconds,
                "seconds_by_tier": {t: self.seconds_by_tier[t] for t in read},
                "bytes_by_tier": {t: self.bytes_by_tier[t] for t in read},
                "gb_per_s": self.gb_per_s}


class TierBackend(ABC):
    """Data movement between tiers.

    Every ``*_to_*`` call captures the data it needs before returning (the caller frees or
    reuses the source right after) and may finish the copy in the background. Those that
    return bool may refuse (back-pressure, disabled tier): nothing was recorded then.
    """

    host_capacity: int  # L2 pages (0: no L2)
    disk_capacity: int  # L3 pages the tree may index (0: no L3)
    codec_tag: str  # the disk codec's: part of every L3 key
    host_page_nbytes: int = 0  # bytes of one page in L2 (0: not tracked)
    moved: dict[str, int]  # pages per move (``MOVES``)

    def disk_key(self, page_hash: bytes) -> DiskKey:
        return disk_key(page_hash, self.codec_tag)

    def writing(self, page_hashes: list[bytes]) -> bool:
        """Whether an L3 write of some of these pages is still queued (any thread; the tree
        records L3 when the write is queued). A backend that writes in place never is."""
        return False

    # ---------------------------------------------------------------- L2 slots
    @abstractmethod
    def host_alloc(self, n: int) -> list[int] | None: ...

    @abstractmethod
    def host_free(self, slots: list[int]) -> None: ...

    # ---------------------------------------------------------------- copies down
    @abstractmethod
    def device_to_host(self, pages: list[int], slots: list[int]) -> None: ...

    @abstractmethod
    def device_to_disk(self, pages: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool:
        """``ids``: the page each file holds, recorded in its header."""

    @abstractmethod
    def host_to_disk(self, slots: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool: ...

    # ---------------------------------------------------------------- copies up
    @abstractmethod
    def disk_to_host(self, keys: list[DiskKey], ids: list[PageId], slots: list[int]) -> Future:
        """Read L3 pages into L2 ``slots`` in the background: the future's result is True once
        all are in place, False if any could not be read (then the slots hold garbage)."""

    # ---------------------------------------------------------------- files and loads
    @abstractmethod
    def disk_contains(self, key: DiskKey, indexed: bool = False) -> bool:
        """Is a page the tree does not index on L3? ``indexed``: ask only the store's in-memory
        index, no system call (misses files other processes added since start-up)."""

    @abstractmethod
    def write_file(self, key: str, data: Callable[[], torch.Tensor], nbytes: int,
                   token_count: int, page: PageId) -> bool:
        """Write a file that is no tree page (a window snapshot of ``page``) to L3 in the
        background."""

    @abstractmethod
    def read_file(self, key: str, nbytes: int, page: PageId) -> memoryview | None:
        """Such a file's payload (``nbytes``), or None if absent, bad or another page's."""

    @abstractmethod
    def start_load(self, job: LoadJob) -> None:
        """Begin filling ``job.dest`` (``job.done`` once the data is in place)."""

    def stream_layers(self, job: LoadJob) -> bool:
        """Make ``job`` (not started) a layer-wise load if this backend can run it as one:
        every page from L3 files, into a CPU pool (``layer_stream.py``)."""
        return False

    def finish_load(self, job: LoadJob, n: int) -> None:
        """The first ``n`` loaded pages of ``job`` were adopted: count their moves."""
        for t in job.page_tiers[:n]:
            self.moved[f"{TIER_NAMES[t]}->device"] += 1

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block until some load finishes (or ``timeout``); False if none was in flight."""

    # ---------------------------------------------------------------- housekeeping
    @abstractmethod
    def poll_failed_writes(self) -> list[DiskKey]:
        """Keys of L3 writes that failed since the last call (their tree records are stale)."""

    @abstractmethod
    def close(self, timeout: float | None = None) -> bool:
        """Let pending writes land (up to ``timeout``), stop; True if all landed."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...


class CountingBackend(TierBackend):
    """Moves nothing and only counts pages (``moved``); L2 slots are plain ids, L3 never
    persists (``disk_contains`` is always False)."""

    def __init__(self, host_pages: int = 0, disk_pages: int = 0, codec_tag: str = "count") -> None:
        self.host_capacity = host_pages
        self.disk_capacity = disk_pages
        self.codec_tag = codec_tag
        self._free_slots = list(range(host_pages - 1, -1, -1))
        self.moved = dict.fromkeys(MOVES, 0)  # pages per move

    def host_alloc(self, n: int) -> list[int] | None:
        if n > len(self._free_slots):
            return None
        out = self._free_slots[len(self._free_slots) - n :]
        del self._free_slots[len(self._free_slots) - n :]
        return out

    def host_free(self, slots: list[int]) -> None:
        self._free_slots.extend(slots)

    def device_to_host(self, pages: list[int], slots: list[int]) -> None:
        self.moved["device->host"] += len(pages)

    def device_to_disk(self, pages: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool:
        self.moved["device->disk"] += len(pages)
        return True

    def host_to_disk(self, slots: list[int], keys: list[DiskKey], ids: list[PageId]) -> bool:
        self.moved["host->disk"] += len(slots)
        return True

    def disk_to_host(self, keys: list[DiskKey], ids: list[PageId], slots: list[int]) -> Future:
        """Completes at once."""
        self.moved["disk->host"] += len(slots)
        done: Future = Future()
        done.set_result(True)
        return done

    def disk_contains(self, key: DiskKey, indexed: bool = False) -> bool:
        return False

    def write_file(self, key: str, data: Callable[[], torch.Tensor], nbytes: int,
                   token_count: int, page: PageId) -> bool:
        return False

    def read_file(self, key: str, nbytes: int, page: PageId) -> memoryview | None:
        return None

    def start_load(self, job: LoadJob) -> None:
        """Completes at once."""
        job.page_tiers = [t for t, _ in job.sources][: len(job.dest)]
        job.num_loaded = len(job.page_tiers)
        job.done = True

    def wait(self, timeout: float | None = None) -> bool:
        return False

    def poll_failed_writes(self) -> list[DiskKey]:
        return []

    def close(self, timeout: float | None = None) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"pages_moved": dict(self.moved)}
