"""Quantized weight formats, the kernels that run them, and their use in the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.quant.kernels import QuantPlan, fbgemm_engine, plan_quantization
from deepinfer.quant.linear import QuantizedLinear, quantize_model, quantize_weight
from deepinfer.quant.weights import QuantizedWeight, pack_int4, quantize_int4, quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_within_half_a_step(group):
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 48)[:, None]
    q = quantize_int8(w, group)
    groups = 96 // (group or 96)
    assert q.codes.dtype == torch.int8 and q.scale.shape == (48, groups)
    assert (q.offset is None) == (group is None)  # per channel: symmetric, for fbgemm
    err = (q.dequantize(torch.float32) - w).abs().view(48, groups, -1)
    assert torch.all(err <= q.scale[..., None] / 2 + 1e-6)
    codes = q.codes.view(48, groups, -1).int()
    assert torch.all(codes.abs().amax(dim=-1) == 127) if group is None else \
        torch.all((codes.amin(dim=-1) == -128) & (codes.amax(dim=-1) == 127))


def test_int4_round_trip_within_half_a_step_per_group():
    w = torch.randn(16, 128)
    q = quantize_int4(w)
    assert q.codes.shape == (16, 64) and q.scale.shape == (16, 4) and q.shape == (16, 128)
    err = (q.dequantize(torch.float32) - w).abs().view(16, 4, 32)
    assert torch.all(err <= q.scale[..., None] / 2 + 1e-6)
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert torch.equal(QuantizedWeight(packed, q.scale[:3, :2], q.offset[:3, :2], 4, 32).values(), codes)
    with pytest.raises(ValueError, match="divisible by the quantization group"):
        quantize_int4(torch.randn(4, 40))


@pytest.mark.parametrize("scheme,kernel,dtype,tol", [
    ("int8", "dequant", torch.float32, 1e-5), ("int4", "dequant", torch.float32, 1e-5),
    ("int4", "tinygemm", torch.bfloat16, 3e-2), ("int8", "fbgemm", torch.float32, 5e-2)])
def test_kernels_match_the_dequantized_weight(scheme, kernel, dtype, tol):
    if kernel == "fbgemm" and fbgemm_engine() is None:
        pytest.skip("torch has no quantized engine here")
    linear = nn.Linear(128, 80, bias=True)
    model = nn.Sequential(linear)
    quantize_model(model, QuantPlan(scheme, kernel))
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.kernel == kernel
    w = quantize_weight(linear.weight.data, QuantPlan(scheme, kernel)).dequantize(torch.float32)
    x = torch.randn(2, 5, 128)
    ref = F.linear(x, w, linear.bias.data)
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 5, 80)
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


def test_plans():
    assert plan_quantization("none", "auto", CPU, torch.float32) == QuantPlan("none", "none")
    # auto never picks fbgemm: it quantizes activations too (tests/quant/test_native_kernel.py: what it picks)
    assert plan_quantization("int8", "auto", CPU, torch.float32).kernel in ("native", "dequant")
    assert plan_quantization("int8", "dequant", CPU, torch.float32) == QuantPlan("int8", "dequant")
    assert plan_quantization("int4", "auto", torch.device("cuda"), torch.bfloat16).kernel == "dequant"
    assert plan_quantization("int4", "tinygemm", CPU, torch.bfloat16).kernel == "tinygemm"
    fallback = plan_quantization("int4", "tinygemm", CPU, torch.float32)
    assert fallback.kernel == "dequant" and "bfloat16" in fallback.note
    assert plan_quantization("int8", "fbgemm", torch.device("cuda"), torch.bfloat16).kernel == "dequant"
    with pytest.raises(ValueError, match="does not run"):
        plan_quantization("int4", "fbgemm", CPU, torch.float32)
    with pytest.raises(ValueError, match="quantization must be one of"):
        plan_quantization("int3", "auto", CPU, torch.float32)


@pytest.mark.parametrize("bf16_flags,expected", [(("avx512_bf16",), "native"), (("amx_bf16", "avx512_bf16"), "tinygemm")])
def test_auto_int4_in_bf16_takes_tinygemm_only_with_amx(monkeypatch, bf16_flags, expected):
    from deepinfer.hardware import CpuIsa
    from deepinfer.quant import kernels
    from deepinfer.quant.native import native_kernel
    from native_helpers import loaded

    loaded(native_kernel())
    if not kernels.has_tinygemm_cpu():
        pytest.skip("this torch has no tinygemm CPU kernel")
    monkeypatch.setattr(kernels, "cpu_isa", lambda: CpuIsa("test CPU", "AVX512", bf16_flags))
    assert plan_quantization("int4", "auto", CPU, torch.bfloat16) == QuantPlan("int4", expected)
    assert plan_quantization("int4", "auto", CPU, torch.float32) == QuantPlan("int4", "native")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_quantizes_every_linear_layer_and_runs(tiny_llama, scheme):
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(str(tiny_llama), quantization=scheme, progress=False, host_cache_gb=0,
              enable_disk_cache=False)
    model = llm.engine.runner.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 + 1 and all(m.scheme == scheme for m in layers)  # incl. lm_head
    assert f"{scheme} weights" in llm.engine.startup_summary
    kernel = llm.engine.runner.quant_plan.kernel
    assert kernel in ("native", "dequant") and f"|{scheme}-{kernel}" in llm.engine.model_identity
    out = llm.generate([[1, 5, 9, 12]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8
