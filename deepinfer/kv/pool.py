"""The device KV pool: per-layer page buffers and the allocator of page ids.

A page id addresses the same span of ``page_size`` tokens in every layer, so one page table
per sequence serves the whole model. Layers that share KV (``KVSpec.share_with``) get the
owner's buffers: one copy per group.
"""

from __future__ import annotations

import torch

from .layout import KVSpec


class PageAllocator:
    """Free list of page ids. Kept apart from the tensors so the planner can use it alone."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Page 0 is reserved as padding for batched decode page tables.
        self._free = list(range(num_pages - 1, 0, -1))
        # Overlap scheduling (``overlap.py``): while a step is in flight, freed pages are parked
        # here, not reused, because that step may still read or write them.
        self._held: list[int] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        (self._free if self._held is None else self._held).extend(pages)

    def hold_frees(self) -> None:
        """From now on ``free`` parks pages (until ``take_held`` or ``release_hold``)."""
        if self._held is None:
            self._held = []

    def take_held(self) -> list[int]:
        """The pages parked so far (``free`` keeps parking)."""
        held = self._held or []
        if self._held is not None:
            self._held = []
        return held

    def return_pages(self, pages: list[int]) -> None:
        """Pages parked by ``free`` that no step in flight uses any more."""
        self._free.extend(pages)

    def release_hold(self) -> None:
        """Nothing is in flight: every parked page is free, and ``free`` frees at once again."""
        self._free.extend(self.take_held())
        self._held = None


class PagePool:
    def __init__(self, specs: list[KVSpec], num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.specs = specs
        self.page_size = page_size
        self.dtype = dtype
        self.allocator = PageAllocator(num_pages)
        self.buffers: list[dict[str, torch.Tensor]] = []
        for spec in specs:
            if spec.share_with is not None:
                self.buffers.append(self.buffers[spec.share_with])
                continue
            self.buffers.append({
                name: torch.zeros(num_pages, spec.rows_per_page(page_size), *shape, dtype=dtype, device=device)
                for name, shape in spec.components
            })

    @staticmethod
    def bytes_per_page(specs: list[KVSpec], page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(s.elements_per_page(page_size) for s in specs if s.owns_cache) * elem

    def owned_buffers(self) -> list[torch.Tensor]:
        """Every distinct buffer, in a fixed order (what a page's bytes consist of)."""
        return [buf for spec, layer in zip(self.specs, self.buffers) if spec.owns_cache
                for buf in layer.values()]

    def read_pages(self, pages: list[int]) -> list[torch.Tensor]:
        """Copies of the given pages from every owned buffer: [n, page_size, ...] each."""
        idx = torch.tensor(pages, device=self.owned_buffers()[0].device)
        return [buf[idx] for buf in self.owned_buffers()]

    def write_pages(self, pages: list[int], data: list[torch.Tensor]) -> None:
        idx = torch.tensor(pages, device=self.owned_buffers()[0].device)
        for buf, d in zip(self.owned_buffers(), data):
            buf.index_copy_(0, idx, d.to(device=buf.device, dtype=buf.dtype))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page ``src`` to page ``dst`` in every owned buffer, for each (src, dst)."""
        if not pairs:
            return
        dev = self.owned_buffers()[0].device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for buf in self.owned_buffers():
            buf.index_copy_(0, dst, buf[src])
