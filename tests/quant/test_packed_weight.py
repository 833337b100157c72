"""The native kernel's packed weight layout (``quant/packed.py``): packing loses nothing, a layer
holds its codes once, and the kernel's result for a row of x does not depend on the rows around
it (the M tiling) nor on a partial last block of 8 output rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.quant.kernels import QuantPlan
from deepinfer.quant.linear import QuantizedLinear, quantize_model
from deepinfer.quant.native import native_kernel, native_linear
from deepinfer.quant.packed import PackedWeight, pack_weight
from deepinfer.quant.weights import QuantizedWeight, pack_int4, quantize_int4, quantize_int8
from native_helpers import loaded


def q4_0(w: torch.Tensor) -> QuantizedWeight:
    """GGUF's Q4_0: d * (q - 8), i.e. an offset of -8 d per group."""
    n, k = w.shape
    d = w.view(n, k // 32, 32).abs().amax(-1) / 7
    q = (torch.round(w.view(n, k // 32, 32) / d[..., None]) + 8).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight(pack_int4(q), d, -8 * d, 4, 32)


def q8_0(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    d = w.view(n, k // 32, 32).abs().amax(-1) / 127
    q = torch.round(w.view(n, k // 32, 32) / d[..., None]).to(torch.int8).view(n, k)
    return QuantizedWeight(q, d, None, 8, 32)


FORMATS = {"int8": quantize_int8, "q8_0": q8_0, "int4 (q4_1)": quantize_int4, "q4_0": q4_0}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 96), (7, 160), (8, 32), (33, 576)])
def test_pack_then_unpack_is_the_same_weight(fmt, n, k):
    loaded(native_kernel())  # dequantize is the kernel's op
    torch.manual_seed(n * k)
    w = FORMATS[fmt](torch.randn(n, k))
    p = pack_weight(w)
    blocks = -(-n // 8)
    assert p.codes.shape == (blocks, k // 32, 8 * 32 * w.bits // 8) and p.scale.shape == (blocks, k // 32, 8)
    back = p.unpack()
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scale, w.scale)
    assert (back.offset is None) == (w.offset is None)
    if w.offset is not None:
        assert torch.equal(back.offset, w.offset)
    assert torch.equal(p.dequantize(torch.float32), w.dequantize(torch.float32))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_layer_holds_one_copy_of_the_codes(scheme):
    loaded(native_kernel())
    model = nn.Sequential(nn.Linear(576, 100))
    quantize_model(model, QuantPlan(scheme, "native"))
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and isinstance(layer.weight, PackedWeight)
    tensors = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert not tensors and not list(layer.buffers())  # nothing but the packed weight and the bias
    code_bytes = 104 * 576 * (1 if scheme == "int8" else 0.5)  # 100 rows padded to 13 blocks of 8
    assert layer.weight.codes.numel() == code_bytes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_bits", [32, 16, 8])
@pytest.mark.parametrize("n", [9, 40])
def test_each_row_of_x_as_if_alone(threads, fmt, act_bits, n):
    """Rows are tiled (4 at a time over each block of 8 output rows; with AVX-512, 8+ rows up to 8
    at a time over two blocks): a row's result is bit for bit the one it gets in a call of its
    own, whatever M and wherever it sits (a verify span's logits equal the decode's)."""
    loaded(native_kernel())
    threads(2)
    torch.manual_seed(n)
    w = pack_weight(FORMATS[fmt](torch.randn(n, 160) / 12))
    x, bias = torch.randn(40, 160) * torch.rand(160) * 3, torch.randn(n)
    y = native_linear(x, w, bias, act_bits)
    for m in range(40):
        assert torch.equal(y[m], native_linear(x[m:m + 1], w, bias, act_bits)[0])
    for m0, m1 in ((5, 13), (0, 16), (3, 20), (0, 32)):
        assert torch.equal(y[m0:m1], native_linear(x[m0:m1].contiguous(), w, bias, act_bits))
