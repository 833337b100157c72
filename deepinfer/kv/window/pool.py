"""Device buffers of the window group and the batch view its layers attend through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...forward_batch import ForwardBatch, PrefillSegment
from ..layout import KVSpec
from .layout import WindowLayout
from .rings import RingAllocator, RingState

if TYPE_CHECKING:
    from ...request import Request


class WindowPool:
    """Device buffers of the window group: ``[num_pages, page_size, *shape]`` per component of
    each owner layer (readers share their owner's), plus the ring allocator."""

    def __init__(self, specs: Sequence[KVSpec], layout: WindowLayout, num_pages: int,
                 ring_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.rings = RingAllocator(num_pages, ring_pages, page_size)
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        for i in sorted(layout.layers):  # owners come before their readers
            s = specs[i]
            if s.share_with is not None:
                self.buffers[i] = self.buffers[s.share_with]
                continue
            self.buffers[i] = {name: torch.zeros(num_pages, page_size, *shape, dtype=dtype, device=device)
                               for name, shape in s.components}

    @staticmethod
    def bytes_per_page(specs: Sequence[KVSpec], layout: WindowLayout, page_size: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return sum(specs[i].elements_per_token() for i in layout.owners) * page_size * elem

    def owned_buffers(self) -> list[torch.Tensor]:
        return [buf for i in self.layout.owners for buf in self.buffers[i].values()]

    def page_shapes(self) -> list[tuple[int, ...]]:
        """One page of each owned buffer."""
        return [tuple(b.shape[1:]) for b in self.owned_buffers()]

    def read(self, pages: list[int]) -> list[torch.Tensor]:
        """Host copies of ``pages`` of every owned buffer, [n, page_size, ...] each."""
        idx = torch.tensor(pages, device=self.device)
        return [buf.index_select(0, idx).to("cpu") for buf in self.owned_buffers()]  # new tensors

    def write(self, pages: list[int], data: list[torch.Tensor]) -> None:
        idx = torch.tensor(pages, device=self.device)
        for buf, d in zip(self.owned_buffers(), data):
            buf.index_copy_(0, idx, d.to(device=buf.device, dtype=buf.dtype))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy pages ``src -> dst`` on the device, in every owned buffer (a forked sample's
        own ring, from its parent's)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for buf in self.owned_buffers():
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def attach(self, batch: ForwardBatch, decodes: list[tuple[Request, int]],
               prefills: list[tuple[Request, int]], chunk_limit: int) -> None:
        """Give ``batch`` its window view. The cache manager grows each request's ring before a
        step; a runner driven without one (the model tests) gets its rings grown here."""
        for r, n in decodes + prefills:
            if r.ring is None:
                r.ring = RingState()
            if not self.rings.ensure(r.ring, r.num_computed_tokens + n):
                raise RuntimeError("the sliding-window ring pool is exhausted")
        batch.window_view = self.view(batch, decodes, prefills, chunk_limit)
        batch.window_layers = self.layout.layers

    def view(self, batch: ForwardBatch, decodes: list[tuple[Request, int]],
             prefills: list[tuple[Request, int]], chunk_limit: int) -> ForwardBatch:
        """The batch as the window layers see it: ring slots for the new tokens and, per
        sequence, the ring pages of its window in position order (masked below its start)."""
        rings, ps, R = self.rings, self.page_size, self.rings.size
        dev = self.device
        slots: list[int] = []
        dec_pages: list[list[int]] = []
        dec_start: list[int] = []
        dec_lo: list[int] = []
        D = self.layout.decode_pages(ps)
        for r, _ in decodes:
            ring, pos = r.ring, r.num_computed_tokens
            P = pos // ps
            slots.append(rings.page(ring, P) * ps + pos % ps)
            dec_pages.append([rings.page(ring, a) for a in range(P - D + 1, P + 1)])
            dec_start.append((P - D + 1) * ps)
            dec_lo.append(ring.valid_from)
        segments: list[PrefillSegment] = []
        for (r, n), seg in zip(prefills, batch.prefills):
            if n > chunk_limit:
                raise ValueError(f"a prefill chunk of {n} tokens exceeds the sliding-window ring "
                                 f"(built for chunks of at most {chunk_limit}: window_chunk_tokens)")
            ring, c = r.ring, r.num_computed_tokens
            pos = torch.arange(c, c + n)
            table = torch.tensor(ring.pages)
            slots += (table[(pos // ps) % R] * ps + pos % ps).tolist()
            first = max(0, c - self.layout.window + 1, ring.valid_from) // ps
            pages = [rings.page(ring, a) for a in range(first, (c + n - 1) // ps + 1)]
            segments.append(PrefillSegment(q_start=seg.q_start, q_len=n, kv_len=c + n,
                                           pages=torch.tensor(pages, device=dev),
                                           kv_start=first * ps, kv_lo=ring.valid_from))
        return ForwardBatch(
            input_ids=batch.input_ids, positions=batch.positions,
            slot_mapping=torch.tensor(slots, device=dev, dtype=torch.long), page_size=ps,
            num_decodes=batch.num_decodes,
            decode_pages=torch.tensor(dec_pages, device=dev) if decodes else None,
            decode_kv_lens=batch.decode_kv_lens, prefills=segments,
            logits_indices=batch.logits_indices, workspace=batch.workspace,
            attention_backend=batch.attention_backend,
            decode_kv_start=torch.tensor(dec_start, device=dev) if decodes else None,
            decode_kv_lo=torch.tensor(dec_lo, device=dev) if decodes else None)

