"""The native CPU kernel (``quant/native.py``): outputs vs de-quantize + ``F.linear``, thread-count
invariance, the layer's use of it, and the fallback when it is disabled or does not build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.quant import native
from deepinfer.quant.kernels import QuantPlan, plan_quantization
from deepinfer.quant.linear import NATIVE_MAX_ROWS, QuantizedLinear, quantize_model
from deepinfer.quant.native import native_kernel, native_linear
from deepinfer.quant.weights import QuantizedWeight, quantize_int4, quantize_int8

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    k = native_kernel()
    if not k.loaded:
        pytest.skip(k.error)
    return k


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


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
    y = native_linear(x, w.codes, w.scale, w.offset, bias, w.bits)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_same_bits_on_any_thread_count(kernel, threads, fmt):
    w = FORMATS[fmt](torch.randn(3000, 576) / 24)  # big enough to be split over threads
    x = torch.randn(5, 576)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(native_linear(x, w.codes, w.scale, w.offset, None, w.bits))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_rejects_bad_shapes(kernel):
    w = quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_linear(torch.randn(1, 48), w.codes[:, :48].contiguous(), w.scale, w.offset, None, 8)
    with pytest.raises(RuntimeError, match="float32"):
        native_linear(torch.randn(1, 64).double(), w.codes, w.scale, w.offset, None, 8)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_layer_runs_decode_rows_natively_and_prefill_through_float(kernel, threads, scheme):
    threads(1)
    linear = nn.Linear(128, 96, bias=True)
    model = nn.Sequential(linear)
    quantize_model(model, QuantPlan(scheme, "native"))
    layer = model[0]
    assert isinstance(layer, QuantizedLinear) and layer.kernel == "native"
    w = layer.weight.dequantize(torch.float32)
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):
        x = torch.randn(1, rows, 128)
        ref = F.linear(x, w, linear.bias.data)
        assert (layer(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
    x = torch.randn(NATIVE_MAX_ROWS + 1, 128)  # prefill-sized: exactly the de-quantize path
    assert torch.equal(layer(x), F.linear(x, w, linear.bias.data))
    xb = torch.randn(2, 128, dtype=torch.bfloat16)  # other activation dtypes are computed in fp32
    assert layer(xb).dtype == torch.bfloat16


def test_auto_picks_native_on_cpu_only(kernel):
    assert plan_quantization("int8", "auto", CPU, torch.float32) == QuantPlan("int8", "native")
    assert plan_quantization("int4", "native", CPU, torch.float32) == QuantPlan("int4", "native")
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
