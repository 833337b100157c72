"""KV page codecs: turn one page of KV (a tensor) into bytes for the L2/L3 tiers and back.

The caller flattens a page (dict of component tensors) into one tensor ``x`` whose last dim is a
multiple of the codec's block size; scales are per block of contiguous elements along that dim.

Codecs and their byte layout (little-endian, concatenated in this order):

* ``lossless``: the raw element bytes of ``x`` in its own dtype.
* ``fp8``: one FP8 e4m3 code per element, then one **float32** scale per block (default 32).
  Scale = block amax / 448. float32 rather than float16 because KV may be bfloat16: a bf16 block
  amax above ~2.9e7 would overflow an fp16 scale and tiny amaxes would underflow it; float32 costs
  2 extra bytes per 32 elements (1.125 instead of 1.0625 B/elem) and adds no error of its own.
* ``fp8c``: ``fp8`` of the page's deviations from its per-channel mean, plus the mean (bfloat16)
  and the one token farthest from it, exact (``FP8CenteredCodec``; rows are whole pages).
* ``fp4`` (NVFP4-like): one float32 page scale ``g = page_amax / (448 * 6)``, then the packed
  e2m1 codes (two per byte, even element in the low nibble), then one **FP8 e4m3** scale per block
  of 16. A block's value is ``code * e4m3_scale * g``. The two-level scale (as in NVFP4) gives a
  1-byte block scale the dynamic range of float32: 0.5625 B/elem + 4 bytes per page, against
  0.625 B/elem for an fp16 block scale that could still overflow on bf16 data.
  Block scales below e4m3's normal range (blocks ~3e4 times smaller than the page's largest)
  lose precision; their error stays below ~1e-5 of the page amax.
* ``mxfp4`` (OCP MX-like): packed e2m1 codes, then one E8M0 byte per block of 32
  (scale ``2**(byte - 127)``). The exponent is ``ceil(log2(amax / 6))`` so the block amax never
  clips (OCP's ``floor(log2(amax)) - 2`` can clip values up to 25%); see ``encode``.

Quantisation is round-to-nearest-even in pure torch ops, so it runs on whatever device ``x`` is on.
Non-finite inputs are rejected (a NaN/Inf page is an upstream bug we must not persist).
The interface every codec keeps, ``Codec``, and its shared checks are ``codec_base.py``.
"""

from __future__ import annotations

import math

import torch

from .codec_base import Codec, Shape
from .minifloat import (E2M1, E2M1_MAX, E4M3_MAX, HAS_NATIVE_FP8, e2m1_decode_packed,
                        e4m3_decode, e4m3_encode, e8m0_to_float, pack_nibbles)

__all__ = ["LosslessCodec", "FP8Codec", "FP8CenteredCodec", "FP4Codec", "MXFP4Codec",
           "get_codec", "CODEC_NAMES"]


def _finish(vals: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    """float32 dequantised values -> output. Clamped to dtype's finite range: rounding a value
    near the top of the range up to the next grid point (or a rounded-up scale) must not give inf."""
    fmax = torch.finfo(dtype).max
    return vals.clamp_(-fmax, fmax).to(dtype).reshape(tuple(shape))


def _dense(cols: torch.Tensor) -> torch.Tensor:
    """A column slice of byte rows as a fresh row-major tensor (``contiguous()`` keeps the parent's
    row stride when there is one row, and a dtype view needs it to divide the element size)."""
    return torch.empty(cols.shape, dtype=cols.dtype, device=cols.device).copy_(cols)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """Any contiguous tensor as a flat uint8 tensor (no copy)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- codecs


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):  # one sync; encode copies to the host anyway
        raise ValueError("cannot encode a KV page with NaN or Inf values")
    return amax


class LosslessCodec(Codec):
    """Raw bytes in the tensor's own dtype: exact, no compute."""

    name = "lossless"

    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise ValueError("lossless: expected at least one dim")
        return _byte_view(x)

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        want = self.encoded_nbytes(shape, dtype)
        if buf.dtype != torch.uint8 or buf.numel() != want:
            raise ValueError(f"lossless: expected {want} bytes for {tuple(shape)}, got {buf.numel()}")
        return buf.contiguous().view(dtype).reshape(tuple(shape))

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"lossless: encode_rows expects [n, m], got {tuple(x.shape)}")
        return x.contiguous().view(torch.uint8).reshape(x.shape[0], self.encoded_nbytes(x.shape[1:], x.dtype))

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        n = self._check_row_buf(buf, m, dtype)
        out = buf.contiguous()  # a column slice of page rows: this is the one copy
        if out.data_ptr() == buf.data_ptr():
            out = out.clone()
        return out.view(dtype).reshape(n, m)


class FP8Codec(Codec):
    """FP8 e4m3 codes + one float32 scale (amax/448) per block."""

    name = "fp8"

    def __init__(self, block_size: int = 32, native: bool | None = None) -> None:
        self.block_size = block_size
        self.native = HAS_NATIVE_FP8 if native is None else native

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        nb = self._nblocks(shape)
        return nb * self.block_size + nb * 4

    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        blocks = x.detach().reshape(-1, self.block_size).float()
        scale = _block_amax(blocks) / E4M3_MAX
        xs = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        codes = e4m3_encode(xs, self.native)
        return torch.cat([codes.reshape(-1), _byte_view(scale)])

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        numel = self._check_buf(buf, shape, dtype)
        codes = buf[:numel].reshape(-1, self.block_size)
        scale = buf[numel:].clone().view(torch.float32)
        vals = e4m3_decode(codes, self.native) * scale[:, None]
        return _finish(vals, shape, dtype)

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x)
        n, m = x.shape
        blocks = x.detach().reshape(-1, self.block_size).float()
        scale = _block_amax(blocks) / E4M3_MAX
        xs = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        codes = e4m3_encode(xs, self.native).reshape(n, m)
        return torch.cat([codes, _byte_view(scale).reshape(n, m // self.block_size * 4)], dim=1)

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        n = self._check_row_buf(buf, m, dtype)
        codes = buf[:, :m].reshape(-1, self.block_size)
        scale = buf[:, m:].contiguous().view(torch.float32).reshape(-1)  # [n * nb]
        vals = e4m3_decode(codes, self.native) * scale[:, None]
        return _finish(vals, (n, m), dtype)


class FP8CenteredCodec(Codec):
    """FP8 e4m3 of a page's deviations from its per-channel mean, plus one exact token.

    Keys carry per-channel offsets that are large next to their variation, and e4m3's 3-bit
    mantissa errs relative to the value, so coding ``x - mean`` instead of ``x`` shrinks the error
    where it matters (attention scores move with q . k). The token farthest from the mean (an
    attention-sink token, typically) is kept exact: its few large deviations would otherwise
    carry most of the page's error (its accuracy against ``fp8``: docs/figures/tiers.md;
    ``tests/test_kv_codec_accuracy.py`` holds it to a bound).

    A row is one page of one buffer: ``tokens`` tokens of ``C = m / tokens`` channels. Layout:
    the ``fp8`` row of the deviations (codes, float32 block scales), then the mean as bfloat16
    [C] (the deviations are taken from this rounded mean, so it adds no error), then the exact
    token in the row's dtype [C], then its index (uint16).
    """

    name = "fp8c"

    def __init__(self, tokens: int, block_size: int = 32, native: bool | None = None) -> None:
        self.fp8 = FP8Codec(block_size, native)  # codes the deviations
        self.block_size = block_size
        if not 0 < tokens <= 1 << 16:
            raise ValueError(f"fp8c: tokens per page must be in 1..65536, got {tokens}")
        self.tokens = tokens

    def _channels(self, m: int) -> int:
        if m % self.tokens:
            raise ValueError(f"fp8c: a row of {m} elements is not {self.tokens} tokens")
        return m // self.tokens

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        c = self._channels(math.prod(shape))
        return self.fp8.encoded_nbytes(shape, dtype) + c * (2 + torch.empty((), dtype=dtype).element_size()) + 2

    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode_rows(x.reshape(1, -1)).reshape(-1)

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        return self.decode_rows(buf.reshape(1, -1), math.prod(shape), dtype).reshape(tuple(shape))

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x)
        n, m = x.shape
        c = self._channels(m)
        t = x.detach().reshape(n, self.tokens, c)
        mean = t.float().mean(dim=1).to(torch.bfloat16)  # [n, C]
        dev = t.float() - mean.float()[:, None]
        idx = dev.square().sum(dim=-1).argmax(dim=1)  # [n]
        exact = t[torch.arange(n, device=x.device), idx]  # [n, C], x's dtype
        return torch.cat([self.fp8.encode_rows(dev.reshape(n, m)), _byte_view(mean).reshape(n, -1),
                          _byte_view(exact).reshape(n, -1),
                          _byte_view(idx.to(torch.int16)).reshape(n, 2)], dim=1)

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        n = self._check_row_buf(buf, m, dtype)
        c = self._channels(m)
        k = self.fp8.encoded_nbytes((m,), dtype)
        esz = torch.empty((), dtype=dtype).element_size()
        dev = self.fp8.decode_rows(_dense(buf[:, :k]), m, torch.float32).reshape(n, self.tokens, c)
        mean = _dense(buf[:, k : k + 2 * c]).view(torch.bfloat16).float()
        exact = _dense(buf[:, k + 2 * c : k + (2 + esz) * c]).view(dtype)
        idx = _dense(buf[:, -2:]).view(torch.int16).reshape(n).long() & 0xFFFF
        out = _finish(dev + mean[:, None], (n, self.tokens, c), dtype)
        out[torch.arange(n, device=buf.device), idx] = exact
        return out.reshape(n, m)


class FP4Codec(Codec):
    """NVFP4-like: e2m1 codes, e4m3 scale per block of 16, float32 scale per page."""

    name = "fp4"

    def __init__(self, block_size: int = 16, native: bool | None = None) -> None:
        if block_size % 2:
            raise ValueError("fp4 block size must be even (two codes per byte)")
        self.block_size = block_size
        self.native = HAS_NATIVE_FP8 if native is None else native

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        nb = self._nblocks(shape)
        return 4 + nb * self.block_size // 2 + nb

    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        blocks = x.detach().reshape(-1, self.block_size).float()
        amax = _block_amax(blocks)
        g = amax.max() / (E4M3_MAX * E2M1_MAX)
        g_safe = torch.where(g > 0, g, torch.ones_like(g))
        sb_codes = e4m3_encode(amax / (E2M1_MAX * g_safe), self.native)
        s_used = e4m3_decode(sb_codes, self.native) * g_safe
        xs = blocks / torch.where(s_used > 0, s_used, torch.ones_like(s_used))[:, None]
        packed = pack_nibbles(E2M1.encode(xs))
        return torch.cat([_byte_view(g.reshape(1)), packed, sb_codes])

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        numel = self._check_buf(buf, shape, dtype)
        g = buf[:4].clone().view(torch.float32)
        packed = buf[4 : 4 + numel // 2]
        sb = e4m3_decode(buf[4 + numel // 2 :], self.native) * g
        vals = e2m1_decode_packed(packed).reshape(-1, self.block_size) * sb[:, None]
        return _finish(vals, shape, dtype)

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row gets its own page scale ``g`` (never one scale over many pages or layers)."""
        self._check_rows(x)
        n, m = x.shape
        nb = m // self.block_size
        blocks = x.detach().reshape(-1, self.block_size).float()
        amax = _block_amax(blocks).reshape(n, nb)
        g = amax.amax(dim=1) / (E4M3_MAX * E2M1_MAX)  # [n]
        g_safe = torch.where(g > 0, g, torch.ones_like(g))[:, None]
        sb_codes = e4m3_encode(amax / (E2M1_MAX * g_safe), self.native)  # [n, nb]
        s_used = (e4m3_decode(sb_codes, self.native) * g_safe).reshape(-1)
        xs = blocks / torch.where(s_used > 0, s_used, torch.ones_like(s_used))[:, None]
        packed = pack_nibbles(E2M1.encode(xs)).reshape(n, m // 2)
        return torch.cat([_byte_view(g.contiguous()).reshape(n, 4), packed, sb_codes], dim=1)

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        n = self._check_row_buf(buf, m, dtype)
        nb = m // self.block_size
        g = buf[:, :4].contiguous().view(torch.float32)  # [n, 1]
        packed = buf[:, 4 : 4 + m // 2].reshape(-1)
        sb = (e4m3_decode(buf[:, 4 + m // 2 :], self.native) * g).reshape(-1)  # [n * nb]
        vals = e2m1_decode_packed(packed).reshape(n * nb, self.block_size) * sb[:, None]
        return _finish(vals, (n, m), dtype)


class MXFP4Codec(Codec):
    """MXFP4-like: e2m1 codes, power-of-two E8M0 scale per block of 32.

    Scale exponent = ceil(log2(amax / 6)), so |x| / scale <= 6 and nothing clips; the largest
    element lands in (3, 6]. Worst-case error is amax/4 either way, but not clipping keeps the
    error of the block's largest (most attention-relevant) values at most one e2m1 half-step.
    """

    name = "mxfp4"

    def __init__(self, block_size: int = 32) -> None:
        if block_size % 2:
            raise ValueError("mxfp4 block size must be even (two codes per byte)")
        self.block_size = block_size

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        nb = self._nblocks(shape)
        return nb * self.block_size // 2 + nb

    def encode_to_tensor(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        blocks = x.detach().reshape(-1, self.block_size).float()
        target = _block_amax(blocks) / E2M1_MAX
        mant, ex = torch.frexp(target)  # target = mant * 2**ex, mant in [0.5, 1)
        exp = torch.where(mant == 0.5, ex - 1, ex)  # ceil(log2(target)); exact, no log2 rounding
        # 2**-126 floor keeps scales normal float32 (exact bit construction, no subnormal pow).
        e8m0 = (exp.clamp(-126, 127) + 127).to(torch.int32)
        codes = E2M1.encode(blocks / e8m0_to_float(e8m0)[:, None])
        return torch.cat([pack_nibbles(codes), e8m0.to(torch.uint8)])

    def decode_from_tensor(self, buf: torch.Tensor, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        numel = self._check_buf(buf, shape, dtype)
        packed, e8m0 = buf[: numel // 2], buf[numel // 2 :]
        scale = e8m0_to_float(e8m0.to(torch.int32))
        vals = e2m1_decode_packed(packed).reshape(-1, self.block_size) * scale[:, None]
        return _finish(vals, shape, dtype)

    def encode_rows(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x)
        n, m = x.shape
        if n == 0:
            return torch.empty(0, self.encoded_nbytes((m,), x.dtype), dtype=torch.uint8, device=x.device)
        flat = self.encode_to_tensor(x.reshape(-1))  # blocks never straddle rows: m % block == 0
        return torch.cat([flat[: n * m // 2].reshape(n, m // 2), flat[n * m // 2 :].reshape(n, -1)], dim=1)

    def decode_rows(self, buf: torch.Tensor, m: int, dtype: torch.dtype) -> torch.Tensor:
        n = self._check_row_buf(buf, m, dtype)
        flat = torch.cat([buf[:, : m // 2].reshape(-1), buf[:, m // 2 :].reshape(-1)])
        return self.decode_from_tensor(flat, (n, m), dtype)


_FACTORIES = {
    "lossless": lambda bs, ps: LosslessCodec(),
    "fp8": lambda bs, ps: FP8Codec(bs or 32),
    "fp8c": lambda bs, ps: FP8CenteredCodec(ps, bs or 32),
    "fp4": lambda bs, ps: FP4Codec(bs or 16),
    "mxfp4": lambda bs, ps: MXFP4Codec(bs or 32),
}
CODEC_NAMES: tuple[str, ...] = tuple(_FACTORIES)
PAGE_AWARE = ("fp8c",)  # codecs whose rows must be whole pages (they need the page size)


def get_codec(name: str, block_size: int | None = None, page_size: int | None = None) -> Codec:
    """Codec by name; ``block_size`` overrides the default (ignored by lossless); ``page_size``
    (tokens per encoded row) is required by the page-aware codecs and ignored by the others."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown KV codec {name!r}; valid names: {', '.join(CODEC_NAMES)}")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if name in PAGE_AWARE and page_size is None:
        raise ValueError(f"KV codec {name!r} needs the page size")
    return _FACTORIES[name](block_size, page_size)
