"""Quantized weight formats: per-output-channel int8 and group-wise int4, and how to make them.

int8: ``w[n, k] = q[n, k] * scale[n]``, symmetric, one float32 scale per output channel (row),
the format fbgemm's dynamic linear kernel takes.

int4: ``w[n, k] = q[n, k] * scale[n, g] + offset[n, g]`` for column ``k`` in group ``g = k // group``,
``q`` in 0..15, two values per byte (low nibble: even column). Asymmetric groups of 32 are exactly
GGUF's Q4_1 blocks (``d``, ``m``) and hold its Q4_0 blocks too (``offset = -8 * d``), so those load
without a round trip through float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32  # columns per int4 scale/offset: GGUF's Q4 block, and tinygemm's smallest group


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K // 2], low nibble = even column
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor  # float32 [N, K // group]
    group: int = INT4_GROUP

    def codes(self) -> torch.Tensor:
        """The 4-bit values ``q`` as uint8 [N, K]."""
        return torch.stack((self.packed & 0x0F, self.packed >> 4), dim=-1).flatten(-2)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        q = self.codes().view(n, k // self.group, self.group).to(torch.float32)
        w = q * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k).to(dtype)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Round to the nearest of 255 symmetric levels of each row's absolute maximum."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Round each group of ``group`` columns to 16 levels spanning its min..max."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Weight(pack_int4(q.view(n, k)), scale, lo, group)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 -> uint8 [N, K // 2], low nibble = even column."""
    return q[:, 0::2] | (q[:, 1::2] << 4)
