"""A prefill chunk after cached keys (chunked prefill, prefix-cache tails) against a float64
reference with the explicit bottom-right causal mask: the unmasked prefix + causal split, and
``paged_attention`` over scattered pages taking it or (windows, softcap) keeping the mask."""

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.layers.attention import paged_attention
from deepinfer.layers.chunk_attention import prefix_then_causal, splits_at_prefix

PS = 4


def _reference(q, k, v, prefix, scale, window=None, softcap=None):
    """q [Lq, Hq, D], k/v [prefix + Lq, Hkv, D] -> [Lq, Hq, D] in float64."""
    lq, lk = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos, kpos = torch.arange(prefix, prefix + lq)[:, None], torch.arange(lk)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("prefix,lq", [(1, 1), (7, 5), (40, 3), (3, 300)])
def test_prefix_then_causal_matches_the_masked_reference(dtype, tol, prefix, lq):
    g = torch.Generator().manual_seed(prefix * 1000 + lq)
    Hq, Hkv, D = 6, 2, 16
    q = torch.randn(lq, Hq, D, generator=g).to(dtype)
    k = torch.randn(prefix + lq, Hkv, D, generator=g).to(dtype)
    v = torch.randn(prefix + lq, Hkv, D, generator=g).to(dtype)
    got = prefix_then_causal(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             prefix, 0.25)
    assert got.dtype == dtype and got.shape == (1, Hq, lq, D)
    want = _reference(q, k, v, prefix, 0.25)
    assert (got[0].transpose(0, 1).double() - want).abs().max().item() < tol


def test_only_cpu_and_equal_head_dims_split():
    q, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)
    assert splits_at_prefix(q, v)
    assert not splits_at_prefix(q, v[..., :4])  # MLA: values narrower than keys
    assert not splits_at_prefix(q.to("meta"), v.to("meta"))


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0)])
def test_paged_prefill_chunk_after_cached_pages(window, softcap):
    """Two sequences in one step, each a chunk continuing cached keys on scattered pages."""
    g = torch.Generator().manual_seed(5)
    Hq, Hkv, D, num_pages = 4, 2, 8, 32
    k_cache = torch.randn(num_pages, PS, Hkv, D, generator=g)
    v_cache = torch.randn(num_pages, PS, Hkv, D, generator=g)
    perm = torch.randperm(num_pages, generator=g)
    segs, qs, refs, start = [], [], [], 0
    for prefix, lq in [(9, 6), (13, 2)]:
        n = prefix + lq
        pages = perm[: -(-n // PS)]
        perm = perm[pages.numel():]
        k = k_cache[pages].flatten(0, 1)[:n]
        v = v_cache[pages].flatten(0, 1)[:n]
        q = torch.randn(lq, Hq, D, generator=g)
        segs.append(PrefillSegment(q_start=start, q_len=lq, kv_len=n, pages=pages))
        qs.append((q, k[prefix:], v[prefix:]))
        refs.append(_reference(q, k, v, prefix, 0.3, window, softcap))
        start += lq
    q, k_new, v_new = (torch.cat(t) for t in zip(*qs))
    batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long), positions=torch.zeros(start),
                         slot_mapping=torch.zeros(start), page_size=PS, num_decodes=0, decode_pages=None,
                         decode_kv_lens=None, prefills=segs, logits_indices=torch.zeros(2))
    got = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, 0.3, window=window, softcap=softcap)
    assert (got.double() - torch.cat(refs)).abs().max().item() < 1e-5
