"""The oneDNN packed-weight linear for prefill chunks and large batched decodes
(``layers/prepacked_linear.py``): values within rounding of ``F.linear`` (float32 and bfloat16,
with bias, 3-d inputs, from the first row count past the small-row kernel's), calls below
``MIN_ROWS`` rows going to the wrapped layer, the swap at load (a bf16 LM head included), and no swap
where it is off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers import prepacked_linear as pl
from deepinfer.layers.linear import FusedLinear
from deepinfer.layers.small_row_linear import MAX_ROWS

needs_onednn = pytest.mark.skipif(not pl.prepack_available(torch.float32), reason="torch without oneDNN")
needs_bf16 = pytest.mark.skipif(not pl.prepack_available(torch.bfloat16), reason="no oneDNN bf16 path on this CPU")


class Counting(nn.Linear):
    """An ``nn.Linear`` that counts its calls (which path a call took)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def _linear(n: int, k: int, dtype: torch.dtype) -> Counting:
    torch.manual_seed(n + k)
    lin = Counting(k, n, bias=True)
    return lin.to(dtype)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [pl.MIN_ROWS, 32, 300, 2048])
def test_values_match_f_linear(dtype, rows):
    if not pl.prepack_available(dtype):
        pytest.skip("no oneDNN bf16 path on this CPU")
    lin = _linear(960, 576, dtype)
    layer = pl.PrepackedLinear(lin)
    x = torch.randn(rows, 576).to(dtype)
    with torch.inference_mode():
        y, ref = layer(x), F.linear(x.double(), lin.weight.double(), lin.bias.double())
    scale = float((x.double().abs() @ lin.weight.detach().double().abs().T).max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert lin.calls == int(rows < layer.min_rows)  # float32 keeps F.linear below FP32_MIN_ROWS
    assert y.dtype == dtype and y.shape == (rows, 960)
    assert float((y.double() - ref).abs().max()) / scale < tol


@needs_onednn
def test_few_rows_keep_the_wrapped_layer_and_3d_inputs_split():
    fused = FusedLinear(576, [576, 192, 192]).float()
    nn.init.normal_(fused.weight, std=0.05)
    layer = pl.PrepackedLinear(fused)
    assert layer.out_sizes == [576, 192, 192] and layer.weight is fused.weight
    lin = _linear(576, 576, torch.float32)
    wrapped = pl.PrepackedLinear(lin)
    with torch.inference_mode():
        assert wrapped.min_rows == pl.FP32_MIN_ROWS
        small = torch.randn(wrapped.min_rows - 1, 576)
        assert torch.equal(wrapped(small), F.linear(small, lin.weight, lin.bias)) and lin.calls == 1
        big = torch.randn(2, wrapped.min_rows, 576)
        y = wrapped(big)
        assert lin.calls == 1 and y.shape == (2, wrapped.min_rows, 576)
        torch.testing.assert_close(y, F.linear(big, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
        parts = layer.split(layer(torch.randn(pl.MIN_ROWS, 576)))
    assert [p.shape[-1] for p in parts] == [576, 192, 192]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)
        self.lm_head = nn.Linear(16, 32)


@needs_bf16
def test_bf16_rows_past_the_small_row_kernel_take_the_packed_weight():
    lin = _linear(576, 576, torch.bfloat16)
    layer = pl.PrepackedLinear(lin)
    with torch.inference_mode():
        layer(torch.randn(MAX_ROWS, 576).bfloat16())  # the small-row kernel's last row count: the wrapped layer
        assert lin.calls == 1
        layer(torch.randn(MAX_ROWS + 1, 576).bfloat16())  # one more: the packed weight (was F.linear up to 63)
        assert lin.calls == 1


@needs_onednn
def test_swap_at_load_keeps_a_float32_lm_head():
    model = Tiny()
    assert pl.use_prepacked_linears(model) == 1
    assert isinstance(model.proj, pl.PrepackedLinear) and isinstance(model.lm_head, nn.Linear)


@needs_bf16
def test_swap_at_load_wraps_a_bf16_lm_head_too():
    model = Tiny().bfloat16()
    assert pl.use_prepacked_linears(model) == 2
    assert isinstance(model.proj, pl.PrepackedLinear) and isinstance(model.lm_head, pl.PrepackedLinear)


def test_switched_off_or_unavailable_keeps_the_layers(monkeypatch):
    monkeypatch.setenv(pl.DISABLE_ENV, "1")
    model = Tiny()
    assert not pl.prepack_available(torch.float32)
    assert pl.use_prepacked_linears(model) == 0 and isinstance(model.proj, nn.Linear)
    monkeypatch.delenv(pl.DISABLE_ENV)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert pl.use_prepacked_linears(model) == 0 and isinstance(model.proj, nn.Linear)
    assert not pl.prepack_available(torch.float16)


@needs_bf16
def test_batched_decode_past_the_small_row_kernel_is_greedy_identical_across_threads(tiny_llama, monkeypatch,
                                                                                   no_batch_rows):
    """20 sequences decode together: every linear call of a step has 20 rows, so the packed path
    (the LM head's too) computes them; greedy outputs are the same on 1 and 2 threads."""
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.threads import apply_thread_policy

    rows: list[int] = []
    real = pl.packed_linear
    monkeypatch.setattr(pl, "packed_linear", lambda x, w, b: (rows.append(x.numel() // x.shape[-1]), real(x, w, b))[1])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (20,), generator=g)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2):
            llm = LLM(str(tiny_llama), threads=threads, progress=False, dtype="bfloat16", host_cache_gb=0,
                      enable_disk_cache=False,
                      enable_prefix_cache=False, speculative_config=None)
            outs[threads] = [o.token_ids for o in llm.generate(prompts, params)]
            packed = sum(isinstance(m, pl.PrepackedLinear) for m in llm.engine.runner.model.modules())
    finally:
        apply_thread_policy(before)
    assert outs[1] == outs[2] and all(len(t) == 6 for t in outs[1])
    assert packed and rows.count(20) >= 2 * 5 * packed  # both runs: each of 5 decode steps through every linear
