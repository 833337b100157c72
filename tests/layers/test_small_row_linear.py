"""The small-row linear kernel (``layers/small_row_linear.py``): float32 results within 1e-5 of
``F.linear`` (relative to the size of the sums) on SmolLM2's shapes and odd ones, 1..16 rows,
bfloat16 within its rounding; each output the same bits whatever the row count or thread count;
the swap at load; greedy outputs identical to the ``nn.Linear`` path on a tiny model and SmolLM2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.layers.linear import FusedLinear
from deepinfer.layers.prepacked_linear import PrepackedLinear
from deepinfer.layers.small_row_linear import (DPBF16_ISA, MAX_ROWS, SmallRowLinear, small_rows_kernel,
                                               small_rows_linear, use_small_row_linears)
from native_helpers import loaded

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (7, 13), (33, 100), (5, 8)]


@pytest.fixture(scope="module")
def kernel():
    return loaded(small_rows_kernel())


def _case(n: int, k: int, m: int, dtype=torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(n * 31 + k * 7 + m)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _error(y: torch.Tensor, x, w, b) -> float:
    """Largest deviation from the float64 product, relative to the size of the largest sum."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = (x.double().abs() @ w.double().abs().T).max() + (0 if b is None else b.double().abs().max())
    return float((y.double() - ref).abs().max() / scale)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_within_1e5_of_f_linear(kernel, shape):
    n, k = shape
    x, w, b = _case(n, k, MAX_ROWS)
    exact = F.linear(x.double(), w.double(), b.double())
    scale = float((x.abs() @ w.abs().T).max() + b.abs().max())
    for m in range(1, MAX_ROWS + 1):
        got = small_rows_linear(x[:m], w, b)
        assert float((got - F.linear(x[:m], w, b)).abs().max()) <= 1e-5 * scale, (shape, m)
        assert float((got.double() - exact[:m]).abs().max()) <= 1e-6 * scale  # as close to exact as MKL is
    got = small_rows_linear(x[:3], w, None)  # no bias
    assert float((got - F.linear(x[:3], w)).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (33, 100)])
def test_bfloat16_within_its_rounding(kernel, shape):
    n, k = shape
    for m in (1, 2, 5, 16):
        x, w, b = _case(n, k, m, torch.bfloat16)
        got = small_rows_linear(x, w, b)
        assert got.dtype == torch.bfloat16
        assert _error(got, x, w, b) < 2 ** -8  # the sums are float32, rounded once to bfloat16
        want = F.linear(x, w, b)
        assert _error(got, x, w, b) <= _error(want, x, w, b) + 2 ** -9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_same_bits_for_any_row_or_thread_count(kernel, threads, dtype):
    x, w, b = _case(3072, 576, MAX_ROWS, dtype)
    threads(1)
    alone = torch.cat([small_rows_linear(x[i : i + 1], w, b) for i in range(MAX_ROWS)])
    for t in (1, 2):
        threads(t)
        for m in (2, 3, 4, 7, MAX_ROWS):
            assert torch.equal(small_rows_linear(x[:m], w, b), alone[:m]), (t, m)


@pytest.fixture(scope="module")
def dpbf16(kernel):
    if kernel.isa != DPBF16_ISA:
        pytest.skip(f"the kernel holds {kernel.isa} code (no AVX512-BF16 here)")
    return kernel


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (7, 13), (33, 100), (5, 8), (3, 40)])
def test_dpbf16_within_bf16_rounding_of_f_linear(dpbf16, shape):
    """AVX512-BF16 dots: every product exact in fp32, only the order of the sums differs from
    F.linear, so the result is the exact sum rounded once to bf16 (odd K: masked tails; N % 4:
    partial tiles), as close to it as F.linear's."""
    n, k = shape
    x, w, b = _case(n, k, MAX_ROWS, torch.bfloat16)
    for m, bias in ((1, b), (2, None), (3, b), (4, b), (5, None), (MAX_ROWS, b)):
        got = small_rows_linear(x[:m], w, bias)
        assert _error(got, x[:m], w, bias) < 2 ** -8, (shape, m)
        assert _error(got, x[:m], w, bias) <= _error(F.linear(x[:m], w, bias), x[:m], w, bias) + 2 ** -9


def test_dpbf16_runs_one_row_bf16_calls(dpbf16):
    bf16, fp32 = nn.Linear(576, 960).bfloat16(), nn.Linear(576, 960)
    model = nn.ModuleDict({"bf16": bf16, "fp32": fp32})
    assert use_small_row_linears(model) == 2
    swapped_bf16, swapped_fp32 = model["bf16"], model["fp32"]
    assert (swapped_bf16.min_rows, swapped_fp32.min_rows) == (1, 2)
    x = torch.randn(1, 576)
    assert torch.equal(swapped_bf16(x.bfloat16()), small_rows_linear(x.bfloat16(), bf16.weight, bf16.bias))
    assert torch.equal(swapped_fp32(x), F.linear(x, fp32.weight, fp32.bias))


def test_bad_inputs_raise(kernel):
    x, w, _ = _case(8, 16, 2)
    with pytest.raises(RuntimeError, match="K = x.size"):
        small_rows_linear(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="dtype"):
        small_rows_linear(x.double(), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        small_rows_linear(x, w, torch.randn(7))


def test_swap_keeps_parameters_and_splits_and_prefill_rows_run_f_linear(kernel):
    model = nn.ModuleDict({"qkv": FusedLinear(16, [8, 4, 4], bias=True), "head": nn.Linear(16, 10, bias=False)})
    tied = model["head"].weight
    assert use_small_row_linears(model) == 2
    qkv, head = model["qkv"], model["head"]
    assert isinstance(qkv, SmallRowLinear) and isinstance(head, SmallRowLinear)
    assert head.weight is tied and qkv.out_sizes == [8, 4, 4]
    x = torch.randn(3, 5, 16)  # 15 rows: the kernel
    assert [t.shape[-1] for t in qkv.split(qkv(x))] == [8, 4, 4]
    torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias), rtol=1e-5, atol=1e-5)
    for rows in (1, MAX_ROWS + 1):  # a batch-1 decode and a prefill chunk: F.linear itself
        x = torch.randn(rows, 16)
        assert torch.equal(head(x), F.linear(x, head.weight))


def test_swap_leaves_other_devices_and_dtypes(kernel):
    model = nn.ModuleDict({"fp16": nn.Linear(16, 8).half(), "meta": nn.Linear(16, 8, device="meta")})
    assert use_small_row_linears(model) == 0
    assert type(model["fp16"]) is nn.Linear and type(model["meta"]) is nn.Linear


def _greedy_twice(llm: LLM, monkeypatch, prompts: list[str], max_tokens: int) -> tuple[list, list]:
    """Greedy ids with the kernel, then with ``F.linear`` in every swapped layer (same engine)."""
    assert any(isinstance(m, SmallRowLinear) for m in llm.engine.runner.model.modules())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    native = [o.token_ids for o in llm.generate(prompts, params)]  # batched decode: 1..len(prompts) rows
    monkeypatch.setattr(SmallRowLinear, "forward", lambda self, x: F.linear(x, self.weight, self.bias))
    reference = [o.token_ids for o in llm.generate(prompts, params)]
    return native, reference


def test_greedy_identical_to_f_linear_on_a_tiny_model(kernel, tiny_llama, monkeypatch):
    llm = LLM(str(tiny_llama), enable_prefix_cache=False, host_cache_gb=0, enable_disk_cache=False, progress=False)
    try:
        head = llm.engine.runner.model.lm_head  # wrapped for 17+ rows where oneDNN packs weights
        assert isinstance(head.inner if isinstance(head, PrepackedLinear) else head, SmallRowLinear)
        native, reference = _greedy_twice(llm, monkeypatch, ["hello world", "the cat sat on", "a b c"], 24)
    finally:
        llm.engine.shutdown()
    assert native == reference


def test_greedy_identical_to_f_linear_on_smollm2(kernel, monkeypatch):
    llm = LLM(enable_prefix_cache=False, host_cache_gb=0, enable_disk_cache=False, progress=False)
    try:
        native, reference = _greedy_twice(llm, monkeypatch, ["The capital of France is", "def fibonacci(n):"], 32)
    finally:
        llm.engine.shutdown()
    assert native == reference
