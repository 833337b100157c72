"""Quantized weight format and how to make it: ``w[n, k] = q[n, k] * scale[n, g] + offset[n, g]``,
``g = k // group``, with int8 or int4 codes ``q``.

- int8: codes -128..127; symmetric per output channel (``group`` = in_features, no offset) for
  fbgemm's kernel, else asymmetric groups of 32 (a finer step, free in the de-quantize path).
- int4: asymmetric groups of 32, codes 0..15, 16 bytes per group: byte j holds column j in its
  low nibble and column j + 16 in its high one (GGUF's layout; the native kernel unpacks a group
  into its columns in order with one mask and one shift).

Both hold GGUF's Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``) and, for int8, Q8_0 (``d * q``)
blocks of 32 exactly, so those load without a round trip through float (``quant/gguf_blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # columns per scale: GGUF's block, and tinygemm's smallest group


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K // 2] packed (bits 4, see pack_int4)
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor | None  # float32 [N, K // group]; None: symmetric
    bits: int  # 8 | 4
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k * 2 if self.bits == 4 else k

    def to(self, device: torch.device) -> QuantizedWeight:
        offset = None if self.offset is None else self.offset.to(device)
        return QuantizedWeight(self.codes.to(device), self.scale.to(device), offset, self.bits, self.group)

    def values(self) -> torch.Tensor:
        """The codes ``q`` unpacked, [N, K]."""
        if self.bits == 8:
            return self.codes
        n, k = self.shape
        nibbles = self.codes.view(n, k // GROUP, GROUP // 2)
        return torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-2).view(n, k)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        w = self.values().view(n, k // self.group, self.group).to(torch.float32) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(n, k).to(dtype)


def quantize_int8(w: torch.Tensor, group: int | None = GROUP) -> QuantizedWeight:
    """Per row (``group=None``): 255 symmetric levels of the row's absolute maximum, the format
    fbgemm takes. In groups: 256 levels spanning each group's min..max (half the step)."""
    n, k = w.shape
    g = _groups(w, group or k)
    if group is None:
        scale = g.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
        q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(q.view(n, k), scale, None, 8, k)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 255.0).clamp_min(1e-12)
    offset = lo + 128 * scale  # code -128 is the group's minimum
    q = torch.round((g - offset[..., None]) / scale[..., None]).clamp_(-128, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k), scale, offset, 8, group)


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> QuantizedWeight:
    """Round each group of ``group`` columns to 16 levels spanning its min..max."""
    n, k = w.shape
    g = _groups(w, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_int4(q.view(n, k)), scale, lo, 4, group)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 -> uint8 [N, K // 2]: per group of 32 columns, byte j holds
    column j (low nibble) and column j + 16 (high nibble)."""
    n, k = q.shape
    halves = q.view(n, k // GROUP, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"in_features ({k}) must be divisible by the quantization group ({group})")
    return w.float().view(n, k // group, group)
