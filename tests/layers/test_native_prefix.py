"""The native prefix kernel (a chunk's queries over its cached keys, read from scattered pages)
against a float64 reference, output and log-sum-exp; ``paged_attention`` through it against the
torch path; and where it is picked. Skipped where the build has no AVX512-BF16."""

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.layers.attention import paged_attention
from deepinfer.layers.native_prefix import native_prefix, native_prefix_kernel, prefix_backend


def _runs() -> bool:
    kernel = native_prefix_kernel()
    return kernel.loaded and kernel.isa == "avx512bf16"


def _caches(dtype, num_pages, ps, Hkv, D, g):
    return (torch.randn(num_pages, ps, Hkv, D, generator=g).to(dtype),
            torch.randn(num_pages, ps, Hkv, D, generator=g).to(dtype))


@pytest.mark.parametrize("prefix,lq,ps", [(1, 2, 4), (17, 3, 4), (100, 7, 16), (33, 1, 16)])
def test_prefix_attention_matches_the_reference(prefix, lq, ps):
    if not _runs():
        pytest.skip("no AVX512-BF16 build of the prefix kernel here")
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(prefix * 100 + lq)
    Hq, Hkv, D, num_pages = 6, 2, 64, 64
    k_cache, v_cache = _caches(dtype, num_pages, ps, Hkv, D, g)
    pages = torch.randperm(num_pages, generator=g)[: -(-(prefix + lq) // ps)]
    q = torch.randn(lq, Hq, D, generator=g).to(dtype)
    out, lse = native_prefix(q, k_cache, v_cache, pages, prefix, 0.125)
    k = k_cache[pages].flatten(0, 1)[:prefix].double().repeat_interleave(Hq // Hkv, 1)
    v = v_cache[pages].flatten(0, 1)[:prefix].double().repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("qhd,khd->qhk", q.double(), k) * 0.125  # exact products of the stored values
    want = torch.einsum("qhk,khd->qhd", torch.softmax(s, -1), v)
    assert out.dtype == torch.float32 and out.shape == (lq, Hq, D) and lse.shape == (lq, Hq)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-5


def test_paged_attention_through_the_kernel_matches_the_torch_path():
    """Two prefill chunks after cached pages in one step: the kernel (``auto``) and the gather +
    flash path (``torch``) agree within the dtype's rounding."""
    if not _runs():
        pytest.skip("no AVX512-BF16 build of the prefix kernel here")
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, ps, num_pages = 9, 3, 64, 16, 40
    k_cache, v_cache = _caches(dtype, num_pages, ps, Hkv, D, g)
    perm = torch.randperm(num_pages, generator=g)
    segs, news, start = [], [], 0
    for prefix, lq in [(200, 20), (37, 5)]:
        n = prefix + lq
        pages = perm[: -(-n // ps)]
        perm = perm[pages.numel():]
        own = torch.arange(prefix, n)
        slots = pages[own // ps] * ps + own % ps
        news.append((k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]))
        segs.append(PrefillSegment(q_start=start, q_len=lq, kv_len=n, pages=pages))
        start += lq
    q = torch.randn(start, Hq, D, generator=g).to(dtype)
    k_new, v_new = (torch.cat(t) for t in zip(*news))
    assert prefix_backend(q, k_cache, v_cache, "auto") == "native"
    outs = {}
    for backend in ("auto", "torch"):
        batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long), positions=torch.zeros(start),
                             slot_mapping=torch.zeros(start), page_size=ps, num_decodes=0, decode_pages=None,
                             decode_kv_lens=None, prefills=segs, logits_indices=torch.zeros(2),
                             attention_backend=backend)
        outs[backend] = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, 0.125).float()
    assert (outs["auto"] - outs["torch"]).abs().max().item() < 2e-2


def test_torch_path_where_the_kernel_does_not_apply():
    q, cache = torch.zeros(3, 4, 8), torch.zeros(2, 4, 2, 8)
    assert prefix_backend(q, cache, cache, "torch") == "torch"
    assert prefix_backend(q.to("meta"), cache.to("meta"), cache.to("meta"), "auto") == "torch"
    assert prefix_backend(q, cache, cache, "auto") == "torch"  # float32: torch's flash kernel
    b = q.bfloat16(), cache.bfloat16()
    assert prefix_backend(b[0][..., :7], b[1][..., :7], b[1][..., :7], "auto") == "torch"  # odd head dim
