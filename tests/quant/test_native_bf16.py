"""bf16 activations straight into the native kernel (``csrc/qgemm.cpp``): the same bits as widening
x to fp32 in torch, running the fp32 call and rounding its result to bf16, for every activation
path, weight format, row count and thread count; and a bf16 layer hands its rows over as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepinfer.quant.linear as quant_linear
from deepinfer.quant.kernels import NATIVE_ACT_BITS, QuantPlan
from deepinfer.quant.linear import QuantizedLinear, quantize_model
from deepinfer.quant.native import native_kernel, native_linear
from deepinfer.quant.packed import pack_weight
from deepinfer.quant.weights import QuantizedWeight, quantize_int4, quantize_int8
from native_helpers import loaded


@pytest.fixture(scope="module")
def kernel():
    return loaded(native_kernel())


def symmetric_int8(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    scale = w.view(n, k // 32, 32).abs().amax(-1) / 127
    q = torch.round(w.view(n, k // 32, 32) / scale[..., None]).to(torch.int8).view(n, k)
    return QuantizedWeight(q, scale, None, 8, 32)


FORMATS = {"int8": quantize_int8, "int8 symmetric": symmetric_int8, "int4": quantize_int4}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_bits", [32, 16, 8])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_bf16_in_and_out_is_the_fp32_call_rounded(kernel, threads, fmt, act_bits, nthreads):
    threads(nthreads)
    torch.manual_seed(act_bits + nthreads)
    n, k = 1200, 576
    w = pack_weight(FORMATS[fmt](torch.randn(n, k) / k ** 0.5))
    x = (torch.randn(9, k) * torch.rand(k) * 8).to(torch.bfloat16)
    x[2, :32] = 0
    bias = torch.randn(n)
    for m in (1, 3, 9):
        y = native_linear(x[:m], w, bias, act_bits)
        expected = native_linear(x[:m].float(), w, bias, act_bits).to(torch.bfloat16)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_bf16_layer_passes_its_rows_as_they_are(kernel, threads, monkeypatch, scheme):
    threads(1)
    model = nn.Sequential(nn.Linear(128, 96, bias=True))
    quantize_model(model, QuantPlan(scheme, "native"))
    layer = model[0]
    assert isinstance(layer, QuantizedLinear)
    seen: list[torch.dtype] = []

    def recording(x, *args):
        seen.append(x.dtype)
        return native_linear(x, *args)

    monkeypatch.setattr(quant_linear, "native_linear", recording)
    x = torch.randn(1, 2, 128, dtype=torch.bfloat16)
    y = layer(x)
    assert seen == [torch.bfloat16] and y.dtype == torch.bfloat16 and y.shape == (1, 2, 96)
    expected = native_linear(x[0].float(), layer.weight, layer.bias.float(), NATIVE_ACT_BITS["native"])
    assert torch.equal(y[0], expected.to(torch.bfloat16))
