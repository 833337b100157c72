"""Per-sequence rings: which window-pool pages hold a running sequence's last window.

Position p of a sequence lives in ring slot ``(p // page_size) % R`` (``WindowLayout.ring_pages``).
The allocator holds no tensors: the cache manager grows and frees rings, ``WindowPool`` reads
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..pool import PageAllocator
from .layout import cdiv

if TYPE_CHECKING:
    from .snapshots import WindowSnapshot


@dataclass(eq=False)
class RingState:
    """A running sequence's ring (``Request.ring``)."""

    pages: list[int] = field(default_factory=list)  # ring slot -> window-pool page (lazily grown)
    valid_from: int = 0  # positions below hold no K/V of this sequence: masked
    exact_from: int = 0  # boundaries from here on see an exact window (snapshots allowed)
    snap_upto: int = 0  # boundaries up to here were considered for snapshots
    junction: int = 0  # where the tree match ended (a boundary worth a snapshot)
    restore: WindowSnapshot | None = None  # to copy in at the first allocation


class RingAllocator:
    """Ring pages of the window pool (no tensors: the cache manager uses it as is)."""

    def __init__(self, num_pages: int, ring_pages: int, page_size: int) -> None:
        self.allocator = PageAllocator(num_pages)  # page 0: padding of gathered page tables
        self.size = ring_pages
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def in_use(self) -> int:
        return self.allocator.num_pages - 1 - self.allocator.num_free

    def ensure(self, ring: RingState, num_tokens: int) -> bool:
        """Grow ``ring`` to hold positions below ``num_tokens``; False if the pool is short."""
        need = min(self.size, cdiv(num_tokens, self.page_size)) - len(ring.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        ring.pages += pages
        return True

    def shrink(self, ring: RingState, num_tokens: int) -> int:
        """Give back the ring pages past those positions below ``num_tokens`` need (pages a
        rejected verify span grew the ring by); a full ring stays as it is, since its slots
        wrap. Returns the pages freed."""
        keep = min(self.size, cdiv(num_tokens, self.page_size))
        extra = ring.pages[keep:]
        if extra:
            del ring.pages[keep:]
            self.allocator.free(extra)
        return len(extra)

    def free(self, ring: RingState) -> None:
        self.allocator.free(ring.pages)
        ring.pages = []

    def page(self, ring: RingState, abs_page: int) -> int:
        """Window-pool page holding absolute page ``abs_page`` (0, masked, if none)."""
        if abs_page < 0:
            return 0
        i = abs_page % self.size
        return ring.pages[i] if i < len(ring.pages) else 0

