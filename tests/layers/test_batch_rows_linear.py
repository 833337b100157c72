"""The batch-rows bf16 linear (``layers/batch_rows_linear.py``): the packed layout, values within
bf16 rounding of the float64 product (odd shapes, bias or none, strided rows), each output the
same bits for any row count and thread count, clear errors, the swap at load, and a tiny model's
greedy outputs the same alone or in a batch and on 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.layers import batch_rows_linear as brl
from deepinfer.layers.linear import FusedLinear

SHAPES = [(960, 576), (49, 30), (16, 2), (100, 64)]


@pytest.fixture(scope="module")
def kernel():
    k = brl.batch_rows_kernel()
    if k.isa != brl.KERNEL_ISA:
        pytest.skip(k.error or "the kernel needs AVX512-BF16")
    return k


def _case(n: int, k: int, m: int, bias: bool = True):
    g = torch.Generator().manual_seed(n * 31 + k * 7 + m)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _linear(x, w, b):
    return brl.batch_rows_linear(x, brl.pack_weight(w), None if b is None else b.float(), w.shape[0])


def test_pack_layout_pairs_keys_per_column_and_pads_columns(kernel):
    w = torch.randn(20, 6).bfloat16()
    p = brl.pack_weight(w)
    assert p.shape == (2, 3, 16, 2)
    for n in range(20):
        for k in range(6):
            assert p[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert not p[1, :, 4:].any()  # columns 20..31: zeros


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 9, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_values_within_bf16_rounding(kernel, shape, rows, bias):
    x, w, b = _case(*shape, rows, bias)
    y = _linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    # one rounding of an fp32 sum of exact products: within a bf16 ulp of the exact value
    assert torch.all((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6 * shape[1])


def test_a_row_gets_the_same_bits_at_any_row_count_thread_count_and_row_stride(kernel, threads):
    x, w, b = _case(960, 576, 40)
    full = _linear(x, w, b)
    for m in (1, 7, 8, 17):
        assert torch.equal(_linear(x[:m], w, b), full[:m]), m
    assert torch.equal(torch.cat([_linear(x[i : i + 1], w, b) for i in range(40)]), full)
    wide = torch.zeros(40, 600).bfloat16()
    wide[:, :576] = x
    assert torch.equal(_linear(wide[:, :576], w, b), full)  # rows 600 apart
    threads(1)
    assert torch.equal(_linear(x, w, b), full)


def test_bad_inputs_raise(kernel):
    w = torch.randn(8, 16).bfloat16()
    packed = brl.pack_weight(w)
    with pytest.raises(RuntimeError, match="even"):
        brl.pack_weight(torch.randn(8, 15).bfloat16())
    with pytest.raises(RuntimeError, match="packed must be"):
        brl.batch_rows_linear(torch.randn(2, 18).bfloat16(), packed, None, 8)
    with pytest.raises(RuntimeError, match="bfloat16"):
        brl.batch_rows_linear(torch.randn(2, 16), packed, None, 8)
    with pytest.raises(RuntimeError, match="bias"):
        brl.batch_rows_linear(torch.randn(2, 16).bfloat16(), packed, torch.randn(7), 8)


def test_swap_keeps_parameters_and_splits_and_skips_other_layers(kernel, monkeypatch):
    monkeypatch.setattr(brl, "batch_rows_usable", lambda: True)
    model = nn.ModuleDict({"qkv": FusedLinear(16, [8, 4, 4], bias=True).bfloat16(),
                           "head": nn.Linear(16, 10, bias=False).bfloat16(),
                           "fp32": nn.Linear(16, 8), "odd": nn.Linear(15, 8).bfloat16()})
    tied = model["head"].weight
    assert brl.use_batch_rows_linears(model) == 2
    qkv, head = model["qkv"], model["head"]
    assert isinstance(qkv, brl.BatchRowsLinear) and isinstance(head, brl.BatchRowsLinear)
    assert type(model["fp32"]) is nn.Linear and type(model["odd"]) is nn.Linear
    assert head.weight is tied and qkv.out_sizes == [8, 4, 4]
    x = torch.randn(3, 5, 16).bfloat16()
    y = qkv(x)
    assert y.shape == (3, 5, 16) and [t.shape[-1] for t in qkv.split(y)] == [8, 4, 4]
    torch.testing.assert_close(y.float(), F.linear(x.float(), qkv.weight.float(), qkv.bias.float()),
                               rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(brl, "batch_rows_usable", lambda: False)
    assert brl.use_batch_rows_linears(nn.ModuleDict({"a": nn.Linear(16, 8).bfloat16()})) == 0


def test_usable_only_without_amx(kernel, monkeypatch):
    from deepinfer.hardware import parse_cpuinfo

    amx = parse_cpuinfo("model name : X\nflags : avx512f avx512_bf16 amx_bf16 amx_tile\n", "AVX512")
    monkeypatch.setattr(brl, "cpu_isa", lambda: amx)
    assert not brl.batch_rows_usable()
    monkeypatch.setattr(brl, "cpu_isa", lambda: parse_cpuinfo("flags : avx512f avx512_bf16\n", "AVX512"))
    assert brl.batch_rows_usable()


def test_greedy_the_same_alone_or_batched_and_on_any_thread_count(kernel, tiny_llama, threads):
    """Every bf16 linear of the tiny model runs the kernel; a prompt's greedy tokens are the same
    decoded alone (1-row linears) or among 20 (20-row ones), on 1 thread or 2."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (20,), generator=g)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for n in (2, 1):
        llm = LLM(str(tiny_llama), threads=n, progress=False, dtype="bfloat16", host_cache_gb=0,
                  enable_disk_cache=False, enable_prefix_cache=False, speculative_config=None)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, (nn.Linear, brl.BatchRowsLinear))]
        assert linears and all(isinstance(m, brl.BatchRowsLinear) for m in linears)
        outs[n] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
    assert outs[2] == outs[1]
    llm = LLM(str(tiny_llama), threads=1, progress=False, dtype="bfloat16", host_cache_gb=0,
              enable_disk_cache=False, enable_prefix_cache=False, speculative_config=None)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts[:4]]
    llm.engine.shutdown()
    assert alone == outs[1][:4]
