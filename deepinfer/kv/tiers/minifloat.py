"""Minifloat formats of the KV codecs: FP8 e4m3, FP4 e2m1 (round-to-nearest-even by table lookup,
so any device works; native float8 where torch has it), E8M0 scales and 4-bit code packing.

Decoding is one gather from a table indexed by the code byte (256 float32 values for e4m3; for
packed e2m1, 256 pairs, one per byte, so unpacking costs nothing): the table holds what the
direct conversion gives for each code, so the values are the same, at a fraction of the cost of
converting float8 element by element on CPU."""

from __future__ import annotations

from functools import cache

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
HAS_NATIVE_FP8 = hasattr(torch, "float8_e4m3fn")


def minifloat_grid(exp_bits: int, man_bits: int, bias: int, n_codes: int) -> torch.Tensor:
    """Non-negative values of a minifloat, indexed by magnitude code (codes are monotonic)."""
    vals = []
    for code in range(n_codes):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:  # subnormal
            vals.append(m / (1 << man_bits) * 2.0 ** (1 - bias))
        else:
            vals.append((1 + m / (1 << man_bits)) * 2.0 ** (e - bias))
    return torch.tensor(vals, dtype=torch.float32)


class Minifloat:
    """Round-to-nearest-even onto a small float grid by table lookup (works for any format)."""

    def __init__(self, exp_bits: int, man_bits: int, bias: int, n_codes: int) -> None:
        self.sign_bit = 1 << (exp_bits + man_bits)
        self._grid = minifloat_grid(exp_bits, man_bits, bias, n_codes)
        self._mids = (self._grid[1:] + self._grid[:-1]) / 2  # exact: grid values have few bits
        self.max = float(self._grid[-1])
        self._dev_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(midpoints, signed value per code) on ``device``, built once per device."""
        if device not in self._dev_cache:
            full = torch.zeros(2 * self.sign_bit, dtype=torch.float32)
            full[: len(self._grid)] = self._grid
            full[self.sign_bit : self.sign_bit + len(self._grid)] = -self._grid
            self._dev_cache[device] = (self._mids.to(device), full.to(device))
        return self._dev_cache[device]

    def encode(self, xs: torch.Tensor) -> torch.Tensor:
        """float32 values (already scaled) -> uint8 codes; saturates at +-max."""
        mids, _ = self._tables(xs.device)
        a = xs.abs().clamp_(max=self.max)
        idx = torch.bucketize(a, mids)  # a == mids[i] lands on i (rounds down) ...
        tie = a == mids[idx.clamp(max=len(mids) - 1)]
        idx = idx + (tie & (idx % 2 == 1)).to(idx.dtype)  # ... so move odd ties up to the even code
        return (idx + torch.signbit(xs).to(idx.dtype) * self.sign_bit).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes -> float32 values."""
        _, full = self._tables(codes.device)
        return full[codes.long()]


E4M3 = Minifloat(exp_bits=4, man_bits=3, bias=7, n_codes=127)  # code 0x7F is NaN in e4m3fn
E2M1 = Minifloat(exp_bits=2, man_bits=1, bias=1, n_codes=8)


def e4m3_encode(xs: torch.Tensor, native: bool) -> torch.Tensor:
    if native:
        return xs.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return E4M3.encode(xs)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """Decode table ``name`` on ``device``, built once: e4m3 (native conversion or the table
    format), or e2m1 pairs [256, 2] (low nibble, high nibble)."""
    if (name, device) not in _TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        if name == "e4m3-native":
            t = codes.view(torch.float8_e4m3fn).float()
        elif name == "e4m3":
            t = E4M3.decode(codes)
        else:
            t = torch.stack([E2M1.decode(codes & 0x0F), E2M1.decode(codes >> 4)], dim=1)
        _TABLES[name, device] = t.to(device)
    return _TABLES[name, device]


def _gather(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` for uint8 codes, flat (int32 indices: the cheapest gather on CPU)."""
    return table.index_select(0, codes.reshape(-1).to(torch.int32))


def e4m3_decode(codes: torch.Tensor, native: bool) -> torch.Tensor:
    """uint8 codes -> float32 of the same shape."""
    return _gather(_table("e4m3-native" if native else "e4m3", codes.device), codes).reshape(codes.shape)


@cache
def decode_tables(native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU tables the decode gathers from: e4m3 [256] and e2m1 [16] float32 (for native code
    that must give the same values; built once: every native decode call passes them)."""
    cpu = torch.device("cpu")
    return _table("e4m3-native" if native else "e4m3", cpu), _table("e2m1-pairs", cpu)[:16, 0].contiguous()


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes (two codes each, even element in the low nibble) -> flat float32."""
    return _gather(_table("e2m1-pairs", packed.device), packed).reshape(-1)


def e8m0_to_float(e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (as int32) -> 2**(byte - 127) as float32, built from the bit pattern (exact)."""
    normal = (e8m0 << 23).view(torch.float32)
    return torch.where(e8m0 == 0, torch.full_like(normal, 2.0**-127), normal)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.reshape(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)
