"""A page's bytes in a lower tier, and the device pool they are copied from and to.

For each buffer the pool owns (``PagePool.owned_buffers``: each layer's K and V, or an MLA
latent), the page's slice flattened and encoded on its own (FP4's per-page scale must not span
layers), concatenated in buffer order. ``encode_pages`` / ``decode_pages`` do it for many pages
at once (``Codec.encode_rows``).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..pool import PagePool
from .codec_base import Codec
from .native_pages import decode_into, encode_native, native_decodes, native_encodes


class KVTransfer(Protocol):
    """Where L1 pages are read from and written to (``PoolTransfer`` over the ``PagePool``)."""

    shapes: list[tuple[int, ...]]  # per owned buffer: one page's shape, [page_size, *per_token]
    dtype: torch.dtype
    device: torch.device
    # per layer that owns a cache: its owned buffers (consecutive indices into ``shapes``);
    # per model layer: the group whose KV it reads (its own, or that of the layer it shares)
    buffer_groups: list[range]
    layer_group: list[int]

    def read_pages(self, pages: list[int]) -> list[torch.Tensor]: ...

    def write_pages(self, pages: list[int], data: list[torch.Tensor]) -> None: ...

    def write_buffers(self, buffers: range, pages: list[int], data: list[torch.Tensor]) -> None:
        """``write_pages`` of some owned buffers only (one layer's, for a layer-wise load)."""
        ...

    def page_views(self, page: int) -> list[memoryview] | None:
        """Writable views of one page's bytes, per owned buffer (in the lossless byte layout),
        for reads straight into L1; None where the pool is not in host memory."""
        ...

    def host_buffers(self) -> list[torch.Tensor] | None:
        """The owned buffers [num_pages, *page_shape], for decodes straight into them; None
        where the pool is not in contiguous host memory."""
        ...


class PoolTransfer:
    """``KVTransfer`` over a ``PagePool``."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        bufs = pool.owned_buffers()
        self._buffers = bufs  # (a load's every decode call asks for them)
        self.shapes = [tuple(b.shape[1:]) for b in bufs]
        self.dtype = pool.dtype
        self.device = bufs[0].device
        # per owned buffer: its bytes as one flat memoryview, and one page's byte count
        self._bytes = ([memoryview(b.view(torch.uint8).reshape(-1).numpy()) for b in bufs]
                       if self.device.type == "cpu" and all(b.is_contiguous() for b in bufs) else None)
        self._page_nbytes = [b[0].numel() * b.element_size() for b in bufs]
        self.buffer_groups, self.layer_group, first = [], [], 0
        for spec in pool.specs:
            if spec.owns_cache:
                self.buffer_groups.append(range(first, first + len(spec.components)))
                first += len(spec.components)
            # a sharing layer reads the group of the (earlier) layer it shares
            shared = spec.share_with
            self.layer_group.append(len(self.buffer_groups) - 1 if spec.owns_cache
                                    else self.layer_group[shared] if shared < len(self.layer_group)
                                    else -1)  # -1: no layer-wise loads

    def read_pages(self, pages: list[int]) -> list[torch.Tensor]:
        return self.pool.read_pages(pages)

    def write_pages(self, pages: list[int], data: list[torch.Tensor]) -> None:
        self.pool.write_pages(pages, data)

    def write_buffers(self, buffers: range, pages: list[int], data: list[torch.Tensor]) -> None:
        idx = torch.tensor(pages, device=self.device)
        bufs = self.pool.owned_buffers()
        for j, d in zip(buffers, data):
            bufs[j].index_copy_(0, idx, d.to(bufs[j].dtype))

    def page_views(self, page: int) -> list[memoryview] | None:
        if self._bytes is None:
            return None
        return [mv[page * n : (page + 1) * n] for mv, n in zip(self._bytes, self._page_nbytes)]

    def host_buffers(self) -> list[torch.Tensor] | None:
        return None if self._bytes is None else self._buffers


def page_nbytes(codec: Codec, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Encoded bytes of one page (all buffers)."""
    return sum(codec.encoded_nbytes((math.prod(s),), dtype) for s in shapes)


def encode_pages(codec: Codec, data: list[torch.Tensor]) -> torch.Tensor:
    """Per-buffer page tensors [n, *page_shape] -> [n, page_nbytes] uint8 (on data's device);
    natively for CPU pages where ``native_encodes`` (same bytes)."""
    if data[0].device.type == "cpu" and native_encodes(codec, data[0].dtype):
        return encode_native(codec, data)
    n = data[0].shape[0]
    return torch.cat([codec.encode_rows(d.reshape(n, -1)) for d in data], dim=1)


DECODE_GROUP_ELEMENTS = 1 << 18  # values one decode call makes on CPU: they stay in cache


def decode_pages(codec: Codec, rows: torch.Tensor, shapes: list[tuple[int, ...]],
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Inverse of ``encode_pages``: [n, page_nbytes] uint8 -> per-buffer [n, *page_shape].
    Lossless pages come back as views into ``rows`` (no copy: a buffer's bytes are a column
    range whose offset and row stride are multiples of the element size). Other codecs decode
    runs of same-shaped buffers in one call (each row decodes on its own, so grouping changes
    no value), in groups of about ``DECODE_GROUP_ELEMENTS`` values on CPU, all at once on GPUs."""
    n, out, off, i = rows.shape[0], [], 0, 0
    rows = rows.contiguous()
    view = codec.name == "lossless" and rows.shape[1] % torch.empty((), dtype=dtype).element_size() == 0
    while i < len(shapes):
        s, m = shapes[i], math.prod(shapes[i])
        b = codec.encoded_nbytes((m,), dtype)
        if view:
            out.append(rows[:, off : off + b].view(dtype).reshape(n, *s))
            off, i = off + b, i + 1
            continue
        most = DECODE_GROUP_ELEMENTS // max(1, n * m) if rows.device.type == "cpu" else len(shapes)
        k = 1
        while i + k < len(shapes) and shapes[i + k] == s and k < most:
            k += 1
        group = rows[:, off : off + k * b].reshape(n, k, b).reshape(n * k, b)
        vals = codec.decode_rows(group, m, dtype).reshape(n, k, *s)
        out += [vals[:, j] for j in range(k)]
        off, i = off + k * b, i + k
    if off != rows.shape[1]:
        raise ValueError(f"page rows of {rows.shape[1]} bytes, layout needs {off}")
    return out


def write_decoded(codec: Codec, rows: torch.Tensor, transfer: KVTransfer, pages: list[int],
                  buffers: range | None = None) -> None:
    """Decode page rows [n, nbytes] (of the owned ``buffers``, default all) into L1 pages
    ``pages``: natively, straight into a host pool, where ``native_decodes``; else through
    ``decode_pages`` and a write (same values)."""
    group = range(len(transfer.shapes)) if buffers is None else buffers
    host = transfer.host_buffers()
    if host is not None and rows.device.type == "cpu" and native_decodes(codec, transfer.dtype):
        decode_into(codec, rows, [host[j] for j in group], pages)
        return
    vals = decode_pages(codec, rows, [transfer.shapes[j] for j in group], transfer.dtype)
    if buffers is None:
        transfer.write_pages(pages, vals)
    else:
        transfer.write_buffers(group, pages, vals)


def check_codec(codec: Codec, shapes: list[tuple[int, ...]]) -> None:
    for s in shapes:
        if math.prod(s) % codec.block_size:
            raise ValueError(f"KV codec {codec.tag}: a page buffer of {math.prod(s)} elements "
                             f"{s} is not a multiple of its block size {codec.block_size}")
