"""Native page encode (``native_pages.encode_native``): the torch encode's bytes, byte for byte,
for every codec it covers, dtype and page layout, on random pages and on the edge cases of the
rounding (ties, subnormals, the dtype's top, zeros of both signs); NaN / Inf refused as there."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.tiers.codecs import get_codec
from deepinfer.kv.tiers.native_pages import encode_native, native_encodes, page_codecs_kernel
from deepinfer.kv.tiers.page_bytes import encode_pages

PS = 16
CODECS = [("fp8", None), ("fp8", 16), ("fp8", 4), ("fp4", None), ("fp4", 32), ("fp4", 4),
          ("mxfp4", None), ("mxfp4", 16)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(PS, 2, 16), (PS, 1, 48), (PS, 1, 32), (PS, 3, 64)]  # per buffer: one page's shape

pytestmark = pytest.mark.skipif(not page_codecs_kernel().loaded, reason=page_codecs_kernel().error)


def torch_encode(codec, data):
    """The torch encode of ``page_bytes.encode_pages``, whatever path that now takes."""
    n = data[0].shape[0]
    return torch.cat([codec.encode_rows(d.reshape(n, -1)) for d in data], dim=1)


def edge_pages(dtype, seed, n=6):
    """Random pages per buffer, with: a zero page row of both signs, subnormals of the dtype,
    blocks at the dtype's top, a page far below the rest (FP4's e4m3 block scales go subnormal),
    and values on the rounding midpoints of e4m3 / e2m1 once scaled (ties to even)."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).smallest_normal
    out = []
    for s in SHAPES:
        x = torch.randn(n, *s, generator=g).to(torch.float64)
        flat = x.view(n, -1)
        flat[0] = 0.0
        flat[0, 1::2] = -0.0
        flat[1, :32] = tiny * torch.linspace(-1, 1, 32, dtype=torch.float64) / 4  # subnormals
        flat[2, :32] = torch.finfo(dtype).max * torch.linspace(-1, 1, 32, dtype=torch.float64)
        flat[3, 32:] *= 1e-5  # blocks ~1e5 below the page's largest
        # e4m3 midpoints with block amax 448 (fp8 scale 1) and e2m1 midpoints with amax 6 (mxfp4 scale 1)
        flat[4, :16] = torch.tensor([448, 1.0625, 1.1875, -2.125, 0.0009765625 * 1.5, 240, 3.25, -416,
                                     1 / 1024, 0.0029296875, 13, 26, -9.5, 0.5625, 0.6875, 0.8125])
        flat[5, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25,
                                     -1.75, -2.5, -3.5, -5, -6])
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,block", CODECS)
@pytest.mark.parametrize("seed", [0, 1])
def test_native_encode_is_byte_identical_to_torch(name, block, dtype, seed):
    codec = get_codec(name, block, PS)
    assert native_encodes(codec, dtype)
    data = edge_pages(dtype, seed)
    ref = torch_encode(codec, data)
    got = encode_native(codec, data)
    assert got.dtype == torch.uint8 and got.shape == ref.shape
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} bytes differ"
    assert torch.equal(encode_pages(codec, data), ref)  # the save path's encode takes it


@pytest.mark.parametrize("name", ["fp8", "fp4", "mxfp4"])
def test_random_scales_byte_identical(name):
    """Pages whose magnitudes span float32's range (log-uniform), where the block and page scales
    land anywhere on the e4m3 / e8m0 grids."""
    codec = get_codec(name, None, PS)
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(8, PS, 1, 64, generator=g) * torch.exp(torch.rand(8, PS, 1, 64, generator=g) * 160 - 80)
            for _ in range(3)]
    assert torch.equal(encode_native(codec, data), torch_encode(codec, data))


@pytest.mark.parametrize("name", ["fp8", "fp4", "mxfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_pages_are_refused_as_by_torch(name, bad):
    codec = get_codec(name, None, PS)
    data = edge_pages(torch.float32, 0)
    data[2][3, 5, 0, 7] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        torch_encode(codec, data)
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_native(codec, data)


def test_fp8c_and_lossless_stay_on_torch():
    assert not native_encodes(get_codec("fp8c", None, PS), torch.float32)
    assert not native_encodes(get_codec("lossless"), torch.float32)
    assert not native_encodes(get_codec("fp8"), torch.float64)


def test_malformed_input_raises():
    codec = get_codec("fp8")
    with pytest.raises(RuntimeError, match="does not fit block"):
        encode_native(codec, [torch.randn(2, 3, 5)])
    with pytest.raises(RuntimeError, match="same n"):
        encode_native(codec, [torch.randn(2, 32), torch.randn(3, 32)])
