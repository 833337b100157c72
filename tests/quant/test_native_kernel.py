"""The native CPU kernel (``quant/native.py``): float activations vs de-quantize + ``F.linear``, int16
and int8 activations vs a reference written in torch (the same block rounding of x, then exact
integer dots), bf16 activations in and out vs the fp32 call rounded, thread-count invariance, the
layer's use of it, and the fallback when it is disabled or does not build. The kernel's packed
layout itself: tests/quant/test_packed_weight.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.native_build import compiler_flags
import deepinfer.quant.linear as quant_linear
from deepinfer.quant import native
from deepinfer.quant.kernels import NATIVE_ACT_BITS, QuantPlan, plan_quantization
from deepinfer.quant.linear import NATIVE_MAX_ROWS, QuantizedLinear, quantize_model
from deepinfer.quant.native import native_kernel, native_linear
from deepinfer.quant.packed import pack_weight
from deepinfer.quant.weights import QuantizedWeight, quantize_int4, quantize_int8
from native_helpers import loaded

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    return loaded(native_kernel())



def symmetric_int8(w: torch.Tensor) -> QuantizedWeight:
    """Q8_0's format: groups of 32, no offset."""
    n, k = w.shape
    scale = w.view(n, k // 32, 32).abs().amax(-1) / 127
    q = torch.round(w.view(n, k // 32, 32) / scale[..., None]).to(torch.int8).view(n, k)
    return QuantizedWeight(q, scale, None, 8, 32)


FORMATS = {"int8": quantize_int8, "int8 symmetric": symmetric_int8, "int4": quantize_int4}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(80, 96), (33, 160), (1200, 576)])  # K not a multiple of 256
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_matches_dequantized_reference(kernel, threads, fmt, n, k, m, nthreads):
    threads(nthreads)
    torch.manual_seed(n + k + m)
    w = FORMATS[fmt](torch.randn(n, k) / k ** 0.5)
    x, bias = torch.randn(m, k), torch.randn(n)
    ref = F.linear(x.double(), w.dequantize(torch.float32).double(), bias.double())
    y = native_linear(x, pack_weight(w), bias, act_bits=32)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def quantize_activations(x: torch.Tensor, act_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 32 values of a row: codes round(x * L / max|x|) (half to even), L = 2**(bits-1) - 1,
    float32 [M, K / 32, 32], and the block's scale max|x| / L, [M, K / 32]."""
    m, k = x.shape
    limit = 2 ** (act_bits - 1) - 1
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv[..., None]), amax / limit


def reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, act_bits: int) -> torch.Tensor:
    q, d = quantize_activations(x, act_bits)
    n, k = w.shape
    codes = w.values().long().view(n, k // 32, 32).double()
    dots = torch.einsum("mgj,ngj->mng", q.double(), codes)  # exact: integers far below 2**53
    scale = (w.scale[None] * d[:, None]).double()  # the kernel's fp32 product of the two scales
    y = (dots * scale).sum(-1)
    if w.offset is not None:
        block_sums = (d * q.sum(-1)).double()  # the rounded activations' sums, as in the kernel
        y = y + block_sums @ w.offset.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(80, 96), (33, 160), (1200, 576)])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_integer_activations_match_torch_reference(kernel, threads, fmt, n, k, m, nthreads, act_bits):
    threads(nthreads)
    torch.manual_seed(n + k + m)
    w = FORMATS[fmt](torch.randn(n, k) / k ** 0.5)
    x, bias = torch.randn(m, k) * torch.rand(k) * 4, torch.randn(n)  # channels of unequal size
    x[0, :32] = 0  # a block of zeros: scale 0, codes 0
    y = native_linear(x, pack_weight(w), bias, act_bits)
    ref = reference(x, w, bias, act_bits)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_integer_activations_extreme_codes_do_not_saturate(kernel, quantize, act_bits):
    """int8 code -128 against activation codes of +-127 (+-32767) in every position: the largest
    pair sums _mm256_madd_epi16 forms (2 * 128 * 32767) and group sums, which must not overflow int32."""
    k = 64
    w = quantize(torch.cat([-torch.ones(1, k), torch.ones(1, k) * 0.5, torch.linspace(-1, 1, k)[None]]))
    x = torch.cat([-torch.ones(1, k), torch.ones(1, k), torch.linspace(-3, 3, k)[None]])
    y = native_linear(x, pack_weight(w), None, act_bits)
    assert (y.double() - reference(x, w, None, act_bits)).abs().max() <= 1e-5 * k


@pytest.mark.parametrize("act_bits", [16, 8])
def test_integer_activations_error_is_the_rounding_of_x(kernel, threads, act_bits):
    """vs the float path on the same weights: off by no more than the rounding of x allows."""
    threads(1)
    w = quantize_int8(torch.randn(256, 576) / 24)
    x = torch.randn(4, 576)
    packed = pack_weight(w)
    exact = native_linear(x, packed, None, act_bits=32)
    y = native_linear(x, packed, None, act_bits)
    q, d = quantize_activations(x, act_bits)
    rounding = (x - (q * d[..., None]).view_as(x)).abs()  # at most d / 2 per value
    bound = rounding @ w.dequantize(torch.float32).abs().T
    assert ((y - exact).abs() <= bound * 1.001 + 1e-6).all()
    assert not torch.equal(y, exact)


def test_isa_is_the_best_code_the_build_flags_allow(kernel):
    """AVX-512 VNNI code wherever native_build passes its flags (torch on AVX-512, the CPU listing
    F/BW/VL/DQ and VNNI), AVX2 wherever it passes -mavx2, else scalar."""
    flags = compiler_flags()
    expected = "avx512-vnni" if "-mavx512vnni" in flags and "-mavx512vl" in flags else (
        "avx2" if "-mavx2" in flags else "scalar")
    assert kernel.isa == expected


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(80, 96), (33, 160), (1200, 576)])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_vnni_code_gives_the_avx2_loops_bits(kernel, threads, fmt, n, k, act_bits):
    """vpdpwssd (int16 codes) and vpdpbusd (int8 codes as bytes) take the same exact integer dots
    as the AVX2 vpmaddwd loop, and the per-group FMAs run in the same order: equal bit for bit,
    extreme codes (int8 -128, activations +-127 / +-32767) included."""
    if kernel.isa != "avx512-vnni":
        pytest.skip(f"no AVX-512 VNNI code in this build ({kernel.isa})")
    threads(2)
    torch.manual_seed(n + k)
    w = pack_weight(FORMATS[fmt](torch.randn(n, k) / k ** 0.5))
    x = torch.randn(17, k) * torch.rand(k) * 4
    x[1] = -x[1].abs().max()  # every code at the limit
    x[2, :32] = 0
    for m in (1, 2, 3, 4, 17):
        assert torch.equal(native_linear(x[:m], w, None, act_bits), native_linear(x[:m], w, None, act_bits, vnni=False))
    extreme = pack_weight(quantize_int8(torch.cat([-torch.ones(1, k), torch.linspace(-1, 1, k)[None]])))
    assert torch.equal(native_linear(x[:3], extreme, None, act_bits),
                       native_linear(x[:3], extreme, None, act_bits, vnni=False))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(80, 96), (33, 160), (1200, 576)])  # 10, 5 (odd: one block alone), 150 blocks
def test_wide_tiles_give_the_256_bit_loops_bits(kernel, threads, fmt, n, k):
    """The 512-bit tiles of calls of several rows (csrc/qgemm_wide.h) take the same integer dots
    and per-group FMAs as the 256-bit loop: equal bit for bit at every row count, fp32 and bf16
    out, with and without bias, extreme codes included (builds without them: the same call twice)."""
    threads(2)
    torch.manual_seed(n + k)
    w = pack_weight(FORMATS[fmt](torch.randn(n, k) / k ** 0.5))
    x, bias = torch.randn(40, k) * torch.rand(k) * 4, torch.randn(n)
    x[1] = -x[1].abs().max()
    x[2, :32] = 0
    for m in (1, 7, 8, 9, 16, 17, 23, 32, 40):
        for xm in (x[:m], x[:m].bfloat16()):
            for b in (None, bias):
                y, ref = native_linear(xm, w, b, 16), native_linear(xm, w, b, 16, wide=False)
                assert torch.equal(y.view(torch.int16) if y.dtype == torch.bfloat16 else y,
                                   ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref), (m, xm.dtype)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("act_bits", [32, 16, 8])
def test_same_bits_on_any_thread_count(kernel, threads, fmt, act_bits):
    w = FORMATS[fmt](torch.randn(3000, 576) / 24)  # big enough to be split over threads
    x, packed = torch.randn(5, 576), pack_weight(w)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(native_linear(x, packed, None, act_bits))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


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


def test_rejects_bad_shapes(kernel):
    w = pack_weight(quantize_int8(torch.randn(8, 64)))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_linear(torch.randn(1, 48), w, None, 16)
    with pytest.raises(RuntimeError, match="float32"):
        native_linear(torch.randn(1, 64).double(), w, None, 16)
    with pytest.raises(RuntimeError, match="act_bits"):
        native_linear(torch.randn(1, 64), w, None, 4)
    with pytest.raises(RuntimeError, match="packed bytes"):
        native_linear(torch.randn(1, 96), w, None, 16)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("native_kernel_name", sorted(NATIVE_ACT_BITS))
def test_layer_runs_decode_rows_natively_and_prefill_through_float(kernel, threads, scheme, native_kernel_name):
    threads(1)
    linear = nn.Linear(128, 96, bias=True)
    model = nn.Sequential(linear)
    quantize_model(model, QuantPlan(scheme, native_kernel_name))
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.kernel == native_kernel_name
    w = layer.weight.dequantize(torch.float32)
    for rows in (1, NATIVE_MAX_ROWS):
        x = torch.randn(1, rows, 128)
        expected = native_linear(x[0], layer.weight, linear.bias.data, NATIVE_ACT_BITS[native_kernel_name])
        assert torch.equal(layer(x)[0], expected)
    x = torch.randn(NATIVE_MAX_ROWS + 1, 128)  # prefill-sized: exactly the de-quantize path
    assert torch.equal(layer(x), F.linear(x, w, linear.bias.data))
    xb = torch.randn(2, 128, dtype=torch.bfloat16)  # other activation dtypes are computed in fp32
    assert layer(xb).dtype == torch.bfloat16


def test_auto_picks_native_on_cpu_only(kernel):
    assert plan_quantization("int8", "auto", CPU, torch.float32) == QuantPlan("int8", "native")
    assert plan_quantization("int4", "native", CPU, torch.float32) == QuantPlan("int4", "native")
    for variant in ("native-int8", "native-float"):
        assert plan_quantization("int4", variant, CPU, torch.float32) == QuantPlan("int4", variant)
    cuda = plan_quantization("int4", "native", torch.device("cuda"), torch.bfloat16)
    assert cuda.kernel == "dequant" and "CPU code" in cuda.note
    assert plan_quantization("int8", "auto", torch.device("cuda"), torch.bfloat16) == QuantPlan("int8", "dequant")


@pytest.fixture
def fresh_build(monkeypatch):
    """``native_kernel`` re-evaluated under the test's environment, then as it was."""
    native_kernel.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    native_kernel.cache_clear()


def test_disabled_by_env_falls_back_to_dequant(fresh_build):
    fresh_build.setenv(native.DISABLE_ENV, "1")
    assert not native_kernel().loaded
    plan = plan_quantization("int4", "auto", CPU, torch.float32)
    assert plan.kernel == "dequant" and native.DISABLE_ENV in plan.note and "de-quantizing" in plan.note
    assert plan_quantization("int8", "native", CPU, torch.float32).kernel == "dequant"
    assert plan_quantization("int8", "native-float", CPU, torch.float32).kernel == "dequant"


def test_build_failure_falls_back_to_dequant(fresh_build, tmp_path):
    broken = tmp_path / "qgemm.cpp"
    broken.write_text('#error "no kernel today"\n')
    fresh_build.setattr(native, "SOURCE", broken)
    fresh_build.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    result = native_kernel()
    assert not result.loaded and "did not build" in result.error
    plan = plan_quantization("int8", "auto", CPU, torch.float32)
    assert plan.kernel == "dequant" and "did not build" in plan.describe()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_greedy_identical_across_thread_counts(kernel, threads, tmp_path_factory, scheme):
    from tiny_checkpoints import make_checkpoint, tiny_llama_config

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    # wide enough that the kernel splits the MLP and LM head rows over 2 threads
    path = make_checkpoint(tmp_path_factory.mktemp("wide_llama"),
                           tiny_llama_config(hidden_size=256, intermediate_size=1024, vocab_size=2048))
    outs = []
    for n in (1, 2):
        llm = LLM(str(path), quantization=scheme, threads=n, progress=False, host_cache_gb=0,
                  enable_disk_cache=False)
        assert llm.engine.runner.quant_plan.kernel == "native"
        prompts = [[1, 5, 9, 12], [7, 3, 3, 100, 200]]
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))])
    assert outs[0] == outs[1]
