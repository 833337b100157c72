"""L2 host-DRAM tier: a fixed pool of equal-size uint8 slots, one encoded page per slot.

One preallocated ``[num_slots, slot_nbytes]`` uint8 tensor rather than a dict of ``bytes``: a single
buffer can be pinned once (page-locked memory is what makes ``copy_(..., non_blocking=True)`` to and
from CUDA truly asynchronous) and never fragments. The slot size is the codec's exact page size,
``codec.encoded_nbytes(page_shape, dtype)``, so every codec fits the same pool design.
Only the allocator is locked; callers own the data in a slot between ``alloc`` and ``free``.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["HostStore"]


class HostStore:
    """Slot pool of encoded KV pages in host memory (pinned when CUDA is available and asked for)."""

    def __init__(self, capacity_bytes: int, slot_nbytes: int, pin_memory: bool = False) -> None:
        if slot_nbytes <= 0:
            raise ValueError(f"slot_nbytes must be positive, got {slot_nbytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.slot_nbytes = int(slot_nbytes)
        self.num_slots = int(capacity_bytes) // self.slot_nbytes
        self.pinned = bool(pin_memory and torch.cuda.is_available())
        self._buf = torch.empty((self.num_slots, self.slot_nbytes), dtype=torch.uint8, pin_memory=self.pinned)
        self._lengths = [0] * self.num_slots  # bytes written into each slot
        self._used = [False] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))  # stack: low ids first
        self._lock = threading.Lock()
        self._counters = {"allocs": 0, "frees": 0, "alloc_failures": 0, "writes": 0, "reads": 0,
                          "bytes_written": 0}  # fmt: skip

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    def alloc(self) -> int | None:
        """A free slot id, or None when full (the caller evicts, then retries)."""
        with self._lock:
            if not self._free:
                self._counters["alloc_failures"] += 1
                return None
            slot = self._free.pop()
            self._used[slot] = True
            self._lengths[slot] = 0
            self._counters["allocs"] += 1
            return slot

    def free(self, slot: int) -> None:
        with self._lock:
            self._check(slot)
            self._used[slot] = False
            self._free.append(slot)
            self._counters["frees"] += 1

    def write(self, slot: int, data: torch.Tensor | bytes | bytearray | memoryview, non_blocking: bool = False) -> None:
        """Copy an encoded page into a slot. A device tensor with ``non_blocking=True`` into a
        pinned pool returns before the copy ends: synchronise (stream/event) before reading."""
        self._check(slot)
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8:
                raise ValueError(f"expected a uint8 tensor, got {data.dtype}")
            n = data.numel()
            self._check_len(n)
            self._buf[slot, :n].copy_(data.reshape(-1), non_blocking=non_blocking)
        else:
            src = np.frombuffer(data, dtype=np.uint8)
            n = src.size
            self._check_len(n)
            self._buf[slot, :n].numpy()[:] = src
        with self._lock:
            self._lengths[slot] = n
            self._counters["writes"] += 1
            self._counters["bytes_written"] += n

    def read(self, slot: int) -> torch.Tensor:
        """A uint8 view of the bytes written to the slot (no copy; invalid after ``free``)."""
        self._check(slot)
        with self._lock:
            self._counters["reads"] += 1
        return self._buf[slot, : self._lengths[slot]]

    def write_rows(self, slots: list[int], rows: torch.Tensor) -> None:
        """Fill several slots at once: row i of ``rows`` [n, nbytes] (uint8, host) into ``slots[i]``."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != len(slots):
            raise ValueError(f"expected [{len(slots)}, nbytes] uint8 rows, got {tuple(rows.shape)} {rows.dtype}")
        for s in slots:
            self._check(s)
        n = rows.shape[1]
        self._check_len(n)
        if slots:
            idx = torch.tensor(slots, dtype=torch.long)
            self._buf[:, :n].index_copy_(0, idx, rows.to("cpu"))
        with self._lock:
            for s in slots:
                self._lengths[s] = n
            self._counters["writes"] += len(slots)
            self._counters["bytes_written"] += n * len(slots)

    def read_rows(self, slots: list[int]) -> torch.Tensor:
        """A copy of several slots as [n, nbytes] rows (all slots must hold the same length)."""
        for s in slots:
            self._check(s)
        lengths = {self._lengths[s] for s in slots}
        if len(lengths) > 1:
            raise ValueError(f"slots hold different lengths: {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        with self._lock:
            self._counters["reads"] += len(slots)
        return self._buf[torch.tensor(slots, dtype=torch.long), :n]

    def read_raw(self, slots: list[int], nbytes: int) -> torch.Tensor:
        """A copy of the first ``nbytes`` of several slots, allocated or not. For a writer thread
        that orders every write itself and reads slots freed after it was asked to read them:
        their bytes are intact until its own later writes."""
        self._check_len(nbytes)
        with self._lock:
            self._counters["reads"] += len(slots)
        return self._buf[torch.tensor(slots, dtype=torch.long), :nbytes]

    def stats(self) -> dict[str, int | bool]:
        used = self.num_slots - self.num_free
        return {"slots": self.num_slots, "used": used, "free": self.num_free, "slot_nbytes": self.slot_nbytes,
                "capacity_bytes": self.capacity_bytes, "used_bytes": used * self.slot_nbytes,
                "pinned": self.pinned, **self._counters}  # fmt: skip

    def _check(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots) or not self._used[slot]:
            raise ValueError(f"slot {slot} is not allocated")

    def _check_len(self, n: int) -> None:
        if n > self.slot_nbytes:
            raise ValueError(f"{n} bytes do not fit a {self.slot_nbytes}-byte slot")
