"""The native small ops (``layers/native_ops.py``): rotary and RMSNorm (with the residual add)
against torch's code paths they replace, on the shapes and strides the models pass, in float32
and bf16; the same bits on any thread count; torch's code where they do not apply or are disabled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer import native_build
from deepinfer.layers import norm, rotary
from deepinfer.layers import attention
from deepinfer.layers.attention import rotate_and_store, store_kv
from deepinfer.layers.native_ops import argmax_rows, small_ops_apply, small_ops_kernel
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding
from native_helpers import loaded


@pytest.fixture(scope="module")
def kernel():
    return loaded(small_ops_kernel())


def _torch_only(monkeypatch) -> None:
    monkeypatch.setattr(norm, "small_ops_apply", lambda x: False)
    monkeypatch.setattr(rotary, "small_ops_apply", lambda x: False)


def _rotary(dim: int = 64, scaling: float = 0.9) -> RotaryEmbedding:
    return RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), 4096, scaling=scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 200])
def test_rotary_same_bits_as_torch_on_fused_projection_views(kernel, monkeypatch, tokens, dtype):
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (9 + 3 + 3) * 64, generator=g) * 4).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided views, as the models pass them
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    rot = _rotary()
    got = rot(positions, q), rot(positions, k)
    _torch_only(monkeypatch)
    want = rot(positions, q), rot(positions, k)
    assert got[0].dtype == dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_cases_left_to_torch(kernel):
    rot = _rotary(32, scaling=1.0)
    x = torch.randn(2, 4, 64)  # partial rotary: 32 of 64 dims
    positions = torch.tensor([5, 9])
    inv = rot(positions, rot(positions, x), inverse=True)  # inverse runs torch's code
    assert (inv - x).abs().max() < 1e-5
    assert not small_ops_apply(x.to(torch.float16))


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (130, 64), (5, 4, 16)])  # decode, prefill rows, q_norm heads
def test_rms_norm_matches_torch(kernel, monkeypatch, unit_offset, shape):
    g = torch.Generator().manual_seed(sum(shape))
    layer = RMSNorm(shape[-1], 1e-5, unit_offset=unit_offset)
    layer.weight.data = torch.randn(shape[-1], generator=g)
    x, r = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    got = layer(x)
    s, n = layer.add_forward(x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1]))
    _torch_only(monkeypatch)
    want = layer(x)
    want_s, want_n = layer.add_forward(x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1]))
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(s, want_s) and (n - want_n).abs().max() <= 1e-6 * want_n.abs().max()


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (130, 64), (5, 4, 16)])
def test_bf16_rms_norm_matches_torch(kernel, monkeypatch, unit_offset, shape):
    """The residual sum is torch's bf16 add bit for bit; the norm is the float32 op's rounded once,
    so it may differ from torch's by the last bf16 bit where the float32 results straddle a rounding."""
    g = torch.Generator().manual_seed(sum(shape))
    layer = RMSNorm(shape[-1], 1e-5, unit_offset=unit_offset).to(torch.bfloat16)
    layer.weight.data = torch.randn(shape[-1], generator=g).to(torch.bfloat16)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    r = torch.randn(*shape, generator=g).to(torch.bfloat16)
    got = layer(x)
    s, n = layer.add_forward(x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1]))
    _torch_only(monkeypatch)
    want = layer(x)
    want_s, want_n = layer.add_forward(x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1]))
    assert got.dtype == n.dtype == s.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(s, want_s)
    for a, b in ((got, want), (n, want_n)):
        ulp = b.float().abs() * 2.0 ** -7  # one step of bf16's 8-bit significand
        assert ((a.float() - b.float()).abs() <= ulp).all()
        assert (a == b).float().mean() > 0.95


def test_same_bits_on_any_thread_count(kernel):
    before = torch.get_num_threads()
    x = torch.randn(300, 576)
    rot, layer = _rotary(), RMSNorm(576)
    q = torch.randn(300, 9, 64)
    positions = torch.arange(300)
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append((layer(x), layer.add_forward(x, x)[1], rot(positions, q)))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_disabled_build_leaves_torch_code(monkeypatch):
    small_ops_kernel.cache_clear()
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    try:
        x = torch.randn(3, 64)
        assert not small_ops_apply(x)
        layer = RMSNorm(64)
        assert torch.equal(layer(x), F.rms_norm(x, (64,), layer.weight, 1e-6))
    finally:
        monkeypatch.undo()
        small_ops_kernel.cache_clear()


def test_position_beyond_the_table_is_an_error(kernel):
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        _rotary()(torch.tensor([5000]), torch.randn(1, 2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 49152, 50257])
def test_argmax_rows_is_torch_argmax(kernel, dtype, vocab):
    """Ties (common in bf16), all -inf rows, NaNs (the first one wins, as in torch), rows that
    are views with a stride past their length, and vocabularies that leave a tail."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 5, generator=g).to(dtype)[:, :vocab]  # strided rows
    x[1] = x[1].round()  # many exact ties
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, -1] = float("nan")
    x[4, 0] = float("nan") if vocab > 3 else x[4, 0]
    x[5] = 0.0
    x[6, vocab // 3] = x[6].max() + 1
    x[7, -1] = x[7].max() + 1  # the largest in the tail
    x[8, -(vocab % 8 or 8):] = x[8].max()  # ties across the vectors and the tail
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:1]), x[:1].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(kernel, dtype):
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(20, 16, 3, 64, generator=g).to(dtype)
    want = cache.clone()
    qkv = torch.randn(5, 15 * 64, generator=g).to(dtype)
    v = qkv[:, 12 * 64:].view(5, 3, 64)  # a strided view of the fused projection, as the models pass it
    slots = torch.tensor([0, 17, 319, 5, 160])
    assert small_ops_apply(v)
    store_kv(cache, v, slots)
    want.view(-1, 3, 64).index_copy_(0, slots, v)
    assert torch.equal(cache, want)


def test_store_kv_slot_out_of_range_is_an_error(kernel):
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        store_kv(cache, torch.ones(1, 1, 8), torch.tensor([8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_and_store_is_rotary_then_store_kv(kernel, monkeypatch, dtype):
    """The one native call gives the bits of the four torch-path calls, on views of a fused projection."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 15 * 64, generator=g).to(dtype)
    q, k, v = qkv[:, :9 * 64].view(5, 9, 64), qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    caches = [torch.randn(20, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    positions, slots = torch.tensor([3, 90, 4000, 0, 17]), torch.tensor([0, 17, 319, 5, 160])
    rot = _rotary()
    got = rotate_and_store(rot, positions, q, k, v, *caches, slots)
    _torch_only(monkeypatch)
    monkeypatch.setattr(attention, "small_ops_apply", lambda x: False)
    want = rotate_and_store(rot, positions, q, k, v, *want_caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))
