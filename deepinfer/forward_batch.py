"""What one model step computes: the contract between the model runner and the layers.

New tokens of all sequences are flattened into one dimension: first one token for each
decoding sequence, then each prefill chunk in turn. Every layer reads the same batch, so
masks and the decode gather index are built once per step (per window size, per head count)
and reused by all layers; gathered decode K/V land in a ``Workspace`` that outlives the step,
so no layer allocates them anew.

Models with sliding-window rings (``kv/window/``) get a second batch, ``window_view``: the same
tokens with ring slots and ring page tables, whose gathered keys start at ``kv_start`` (a
position, not 0) and are valid only from ``kv_lo``; ``for_layer(i)`` hands each layer its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kv.tiers.layer_stream import LayerLoads


class Workspace:
    """Grow-only scratch buffers owned by the runner: every layer of every step gathers its
    decode K/V into the same memory (a fresh multi-megabyte tensor per layer costs page faults
    on the CPU and allocator traffic on CUDA)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``like``'s dtype and device, contents undefined."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:n].view(shape)


@dataclass
class PrefillSegment:
    q_start: int  # offset of this chunk's first token in the flattened batch
    q_len: int  # tokens computed in this step
    kv_len: int  # context length after this step (cached prefix + earlier chunks + q_len)
    pages: torch.Tensor  # [ceil(kv_len / page_size)] page ids, int64, on the device
    kv_start: int = 0  # position of the first gathered key (ring views: the window's first page)
    kv_lo: int = 0  # keys below this position are masked (nothing of this sequence there)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] page * page_size + offset: where each new token's KV goes
    page_size: int
    num_decodes: int
    decode_pages: torch.Tensor | None  # [B, max_pages], padded with page 0
    decode_kv_lens: torch.Tensor | None  # [B]
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor  # [num_seqs]: the last new token of each sequence
    decode_kv_start: torch.Tensor | None = None  # [B] position of each row's first gathered key
    decode_kv_lo: torch.Tensor | None = None  # [B] keys below are masked
    window_view: ForwardBatch | None = None  # what the window-group layers read (ring pages)
    window_layers: frozenset[int] = frozenset()
    # layer-wise loads of the prefills' cached KV (kv/tiers/layer_stream.py): layer i waits
    # for their layer i
    layer_loads: tuple[LayerLoads, ...] = ()
    attention_backend: str = "auto"  # decode attention: auto (native kernel where it applies) | torch
    workspace: Workspace = field(default_factory=Workspace, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def for_layer(self, i: int) -> ForwardBatch:
        """The batch layer ``i`` reads: the ring view for window-group layers, else this one;
        returns once the layer-wise loads have layer ``i``'s KV in place."""
        for loads in self.layer_loads:
            loads.wait(i)
        if self.window_view is not None and i in self.window_layers:
            return self.window_view
        return self

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def decode_rows(self, heads: int) -> torch.Tensor:
        """[B * heads * L] rows of a cache viewed as ``[num_slots * heads, dim]``, ordered so that
        gathering them yields ``[B, heads, L, dim]``: each decode's keys in position order, head
        by head, the layout attention reads without another copy. Built once per head count."""
        if heads not in self._rows:
            assert self.decode_pages is not None
            dev = self.decode_pages.device
            slots = (self.decode_pages[:, :, None] * self.page_size
                     + torch.arange(self.page_size, device=dev)).flatten(1)  # [B, L]
            rows = slots[:, None, :] * heads + torch.arange(heads, device=dev)[None, :, None]
            self._rows[heads] = rows.flatten()
        return self._rows[heads]

    def decode_mask(self, window: int | None) -> torch.Tensor | None:
        """[B, 1, 1, L] boolean mask over gathered decode pages (None when nothing is masked)."""
        key = ("decode", window)
        if key not in self._masks:
            assert self.decode_pages is not None and self.decode_kv_lens is not None
            L = self.decode_pages.shape[1] * self.page_size
            j = torch.arange(L, device=self.decode_kv_lens.device)[None, :]
            if self.decode_kv_start is not None:
                j = j + self.decode_kv_start[:, None]  # key positions
            lens = self.decode_kv_lens[:, None]
            mask = j < lens
            if self.decode_kv_lo is not None:
                mask &= j >= self.decode_kv_lo[:, None]
            if window is not None:
                mask &= j > lens - 1 - window
            all_valid = (window is None and self.decode_kv_start is None and self.decode_kv_lo is None
                         and bool((self.decode_kv_lens == L).all()))
            self._masks[key] = None if all_valid else mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        """[q_len, kv_len] boolean causal (and window) mask of segment i; None = plain causal."""
        key = ("prefill", i, window)
        if key not in self._masks:
            seg = self.prefills[i]
            if seg.kv_len == seg.q_len and window is None and seg.kv_lo <= 0:
                self._masks[key] = None
            else:
                dev = seg.pages.device
                qpos = torch.arange(seg.kv_len - seg.q_len, seg.kv_len, device=dev)[:, None]
                kpos = torch.arange(seg.kv_start, seg.kv_len, device=dev)[None, :]
                mask = kpos <= qpos
                if seg.kv_lo > seg.kv_start:
                    mask &= kpos >= seg.kv_lo
                if window is not None:
                    mask &= kpos > qpos - window
                self._masks[key] = mask
        return self._masks[key]
