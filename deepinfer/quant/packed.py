"""The native kernel's weight layout (``csrc/qgemm.cpp``): a ``QuantizedWeight`` repacked once at
load so one 256-bit register accumulates 8 output rows, and back.

Per block of 8 output rows (``N`` padded with zero rows to a multiple of 8) and group of 32
columns, the 8 x 32 codes are 16 column pairs, each pair 16 int16 lanes ``[row 0 col 2p, row 0 col
2p+1, row 1 col 2p, ...]`` (lane ``l``: row ``l // 2``, column ``2p + l % 2``). int8 codes: 8 chunks
of 16 lanes, the lane's low byte from pair ``2c``, its high byte from pair ``2c + 1``. int4 codes: 4
chunks of 16 lanes, the lane's 4 nibbles (low first) from pairs ``4c .. 4c + 3``. Scales and offsets
are ``[blocks, groups, 8]``. The bytes are the same as the row-major codes', so memory does not grow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import GROUP, QuantizedWeight, pack_int4

ROWS = 8  # output rows per block: one fp32 AVX2 register


@dataclass
class PackedWeight:
    codes: torch.Tensor  # uint8 [ceil(N / 8), K // 32, 256 (int8) | 128 (int4)]
    scale: torch.Tensor  # float32 [ceil(N / 8), K // 32, 8]
    offset: torch.Tensor | None  # float32 like scale; None: symmetric
    bits: int  # 8 | 4
    out_features: int  # N (the padding rows excluded)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.codes.shape[1] * GROUP

    def unpack(self) -> QuantizedWeight:
        """The row-major ``QuantizedWeight`` this was packed from."""
        nb, groups, _ = self.codes.shape
        n = self.out_features
        if self.bits == 8:
            lanes = self.codes.view(torch.int8).view(nb, groups, 8, 16, 2).transpose(-1, -2)  # (c, s, l)
        else:
            nibbles = torch.stack((self.codes & 0x0F, self.codes >> 4), -1)  # (c, l, byte, nibble)
            lanes = nibbles.view(nb, groups, 4, 16, 4).transpose(-1, -2)  # (c, s, l)
        pairs = lanes.reshape(nb, groups, 16, ROWS, 2)  # (p, r, t)
        values = pairs.permute(0, 3, 1, 2, 4).reshape(nb * ROWS, groups * GROUP)[:n]
        codes = values.contiguous() if self.bits == 8 else pack_int4(values)
        offset = None if self.offset is None else _rows(self.offset, n)
        return QuantizedWeight(codes, _rows(self.scale, n), offset, self.bits, GROUP)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in ``dtype``, straight from the packed codes (the native kernel's op)."""
        w = torch.ops.deepinfer_quant.dequantize(self.codes, self.scale, self.offset, self.out_features, self.bits)
        return w.to(dtype)


def pack_weight(w: QuantizedWeight) -> PackedWeight:
    """``w`` (groups of 32, on the CPU) in the kernel's layout."""
    if w.group != GROUP:
        raise ValueError(f"the native kernel runs weights in groups of {GROUP} only")
    n, k = w.shape
    groups, nb = k // GROUP, -(-n // ROWS)
    values = _pad(w.values(), nb * ROWS)
    pairs = values.view(nb, ROWS, groups, 16, 2).permute(0, 2, 3, 1, 4)  # (b, g, p, r, t)
    if w.bits == 8:
        lanes = pairs.reshape(nb, groups, 8, 2, 16)  # (c, s, l)
        codes = lanes.transpose(-1, -2).contiguous().view(torch.uint8).view(nb, groups, 256)
    else:
        lanes = pairs.reshape(nb, groups, 4, 4, 16).transpose(-1, -2)  # (c, l, s)
        codes = (lanes[..., 0::2] | (lanes[..., 1::2] << 4)).reshape(nb, groups, 128)
    offset = None if w.offset is None else _blocks(w.offset, nb)
    return PackedWeight(codes.contiguous(), _blocks(w.scale, nb), offset, w.bits, n)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t


def _blocks(t: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, groups] -> [blocks, groups, 8] float32, zero rows padded."""
    return _pad(t.float(), nb * ROWS).view(nb, ROWS, -1).transpose(1, 2).contiguous()


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    nb, groups, _ = t.shape
    return t.transpose(1, 2).reshape(nb * ROWS, groups)[:n].contiguous()
