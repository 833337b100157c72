"""The MLP activation ``silu(gate) * up`` of native_ops.silu_mul against torch's two ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers.native_ops import silu_mul, small_ops_kernel
from native_helpers import loaded


@pytest.fixture(scope="module")
def kernel():
    return loaded(small_ops_kernel())


def _reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between finite values of one sign (what the activations give)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (5, 13), (3, 100)])
def test_bf16_within_one_ulp_of_torch(kernel, rows, inter):
    """Our exponential is not torch's: a product may land one bf16 step away (in practice they agree)."""
    g = torch.Generator().manual_seed(rows * inter)
    x = (torch.randn(rows, 2 * inter + 6, generator=g) * 6).bfloat16()[:, : 2 * inter]  # strided rows
    got, want = silu_mul(x), _reference(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _ulps(got, want).max() <= 1


def test_bf16_extremes_are_torch_values(kernel):
    """Saturated gates (e^-g overflowing), infinities and NaN, in the vector part and the scalar
    tail of a row."""
    gate = torch.tensor([-200.0, -110.0, -87.0, -30.0, 0.0, -0.0, 1e30, -1e30, float("inf"), float("-inf"),
                         float("nan"), 1.0, 5.0, -5.0, 100.0, 3.0, -1e30, float("-inf"), float("nan")])
    x = torch.cat((gate, torch.full_like(gate, 1.5))).bfloat16()[None]
    got, want = silu_mul(x), _reference(x)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())


def test_bf16_gate_below_the_exponential_range_gives_zero(kernel):
    """Gates from -103 to -87.3, where e^g is a float32 subnormal, give -0 in the vector part
    (its exponential stops at e^-87.3) where torch gives a product below 1e-36."""
    x = torch.tensor([[-88.0] * 8 + [1.5] * 8]).bfloat16()
    got, want = silu_mul(x), _reference(x)
    assert torch.equal(got, torch.full_like(got, -0.0)) and want.abs().max() < 1e-36


def test_same_bits_on_any_thread_count(kernel):
    x = torch.randn(300, 2 * 1536).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(silu_mul(x))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(silu_mul(x[7:8]), outs[0][7:8])  # a row's bits do not depend on the batch


def test_float32_stays_torch(kernel):
    """float32 keeps torch's ops: transformers' float32 reference gets the same bits."""
    x = torch.randn(4, 2 * 96)
    assert torch.equal(silu_mul(x), _reference(x))
