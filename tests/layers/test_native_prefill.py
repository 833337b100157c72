"""The native prefill kernel (a chunk's queries over its cached keys and, causally, its own, read
from scattered pages) against a float64 reference; ``paged_attention`` through it against the
torch path (cold chunks and chunks after cached pages in one step); the same bits at 1 and 2
threads; and where it is picked. Skipped where the build has no AVX512-BF16."""

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.layers.attention import paged_attention
from deepinfer.layers.native_prefill import native_prefill, native_prefill_kernel, prefill_backend

needs_kernel = pytest.mark.skipif(
    not (native_prefill_kernel().loaded and native_prefill_kernel().isa == "avx512bf16"),
    reason="no AVX512-BF16 build of the prefill kernel here")


def _caches(num_pages, ps, Hkv, D, g):
    return (torch.randn(num_pages, ps, Hkv, D, generator=g).bfloat16(),
            torch.randn(num_pages, ps, Hkv, D, generator=g).bfloat16())


def _reference(q, k_cache, v_cache, pages, start, scale):
    """float64 causal attention of q [T, Hq, D] at positions start.. over the pages' keys."""
    T, Hq, _ = q.shape
    n, rep = start + T, Hq // k_cache.shape[2]
    k = k_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
    v = v_cache[pages].flatten(0, 1)[:n].double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # exact products of the stored values
    visible = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


@needs_kernel
@pytest.mark.parametrize("start,T,Hq,Hkv,D,ps", [
    (0, 1, 6, 2, 64, 4),       # one token, nothing cached
    (0, 37, 9, 3, 64, 16),     # cold chunk, odd length, GQA 3
    (1, 2, 4, 4, 64, 4),       # GQA 1
    (17, 3, 8, 2, 128, 4),     # head dim 128, GQA 4
    (100, 7, 9, 3, 64, 16),    # a short tail after cached pages
    (33, 45, 8, 2, 128, 16),   # tail longer than a tile of rows, GQA 4
    (250, 19, 4, 4, 64, 16),   # GQA 1 over several key tiles
])
def test_prefill_attention_matches_the_reference(start, T, Hq, Hkv, D, ps):
    g = torch.Generator().manual_seed(start * 100 + T)
    num_pages = -(-(start + T) // ps) + 5
    k_cache, v_cache = _caches(num_pages, ps, Hkv, D, g)
    pages = torch.randperm(num_pages, generator=g)[: -(-(start + T) // ps)]
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    out = native_prefill(q, k_cache, v_cache, pages, start, 0.125)
    want = _reference(q, k_cache, v_cache, pages, start, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (T, Hq, D)
    # bf16 probabilities and output: within a few bf16 roundings of the exact result
    assert (out.double() - want).abs().max().item() < 2e-2
    assert (out.double() - want).abs().mean().item() < 2e-3


@needs_kernel
def test_same_bits_at_one_and_two_threads():
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = _caches(40, 16, 3, 64, g)
    pages = torch.randperm(40, generator=g)[:30]
    q = torch.randn(100, 9, 64, generator=g).bfloat16()
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(native_prefill(q, k_cache, v_cache, pages, 373, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@needs_kernel
def test_paged_attention_through_the_kernel_matches_the_torch_path():
    """A cold chunk and two chunks after cached pages in one step: the kernel (``auto``) and the
    torch path (``torch``) agree within the dtype's rounding."""
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, ps, num_pages = 9, 3, 64, 16, 60
    k_cache, v_cache = _caches(num_pages, ps, Hkv, D, g)
    perm = torch.randperm(num_pages, generator=g)
    segs, news, start = [], [], 0
    for prefix, lq in [(200, 20), (0, 53), (37, 5)]:
        n = prefix + lq
        pages = perm[: -(-n // ps)]
        perm = perm[pages.numel():]
        own = torch.arange(prefix, n)
        slots = pages[own // ps] * ps + own % ps
        news.append((k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]))
        segs.append(PrefillSegment(q_start=start, q_len=lq, kv_len=n, pages=pages))
        start += lq
    q = torch.randn(start, Hq, D, generator=g).bfloat16()
    k_new, v_new = (torch.cat(t) for t in zip(*news))
    assert prefill_backend(q, k_cache, v_cache, "auto") == "native"
    outs = {}
    for backend in ("auto", "torch"):
        batch = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.long), positions=torch.zeros(start),
                             slot_mapping=torch.zeros(start), page_size=ps, num_decodes=0, decode_pages=None,
                             decode_kv_lens=None, prefills=segs, logits_indices=torch.zeros(3),
                             attention_backend=backend)
        outs[backend] = paged_attention(q, k_new, v_new, k_cache, v_cache, batch, 0.125).float()
    assert (outs["auto"] - outs["torch"]).abs().max().item() < 2e-2


def test_torch_path_where_the_kernel_does_not_apply():
    q, cache = torch.zeros(3, 4, 16), torch.zeros(2, 4, 2, 16)
    assert prefill_backend(q, cache, cache, "torch") == "torch"
    assert prefill_backend(q.to("meta"), cache.to("meta"), cache.to("meta"), "auto") == "torch"
    assert prefill_backend(q, cache, cache, "auto") == "torch"  # float32: torch's flash kernel
    b = q.bfloat16(), cache.bfloat16()
    assert prefill_backend(b[0][..., :7], b[1][..., :7], b[1][..., :7], "auto") == "torch"  # odd head dim
    assert prefill_backend(b[0][..., :8], b[1][..., :8], b[1][..., :8], "auto") == "torch"  # values not x16


@needs_kernel
def test_bf16_greedy_identical_at_one_and_two_threads(tiny_llama, monkeypatch):
    """Through the engine in bfloat16: chunked cold prefills and a prefix-cache tail run the
    kernel, and greedy tokens do not depend on the thread count."""
    from deepinfer.layers import attention
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.threads import apply_thread_policy

    starts = []

    def counted(q, k_cache, v_cache, pages, start, scale):
        starts.append(start)
        return native_prefill(q, k_cache, v_cache, pages, start, scale)

    monkeypatch.setattr(attention, "native_prefill", counted)
    shared = [(7 * i) % 300 + 10 for i in range(70)]
    prompts = [shared + [5, 9, 12], [2, 8, 8, 31, 40, 41], shared + [77] * 11]
    params = SamplingParams(max_tokens=12, temperature=0)
    before = torch.get_num_threads()
    outs = {}
    try:
        for threads in (1, 2):
            llm = LLM(str(tiny_llama), threads=threads, dtype="bfloat16", progress=False, host_cache_gb=0,
                      enable_disk_cache=False, max_num_batched_tokens=32)
            outs[threads] = [o.token_ids for o in llm.generate(prompts[:2], params)]
            tail = llm.generate(prompts[2:], params)[0]  # after the first prompt's pages
            assert tail.num_cached_tokens >= 64
            outs[threads].append(tail.token_ids)
    finally:
        apply_thread_policy(before)
    assert outs[1] == outs[2] and all(len(t) == 12 for t in outs[1])
    assert 0 in starts and 32 in starts and max(starts) >= 64  # cold, chunked and tail chunks ran it
