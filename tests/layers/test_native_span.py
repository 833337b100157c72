"""The decode kernel's span variant (``paged_span``, used by ``paged_attention`` for chunks of up to
``SPAN_AS_DECODES`` tokens): every row of a span of 1-16 tokens equals, bit for bit, the decode
kernel's row at the same position, in fp32 and bf16, with GQA, windows (shorter and longer than
the span), ring views (``kv_start`` / ``kv_lo``), MLA's values inside keys, pages in random order
and on any thread count."""

from __future__ import annotations

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.layers.attention import SPAN_AS_DECODES, paged_attention
from deepinfer.layers.native_decode import native_decode, native_decode_kernel
from native_helpers import loaded


@pytest.fixture(scope="module")
def kernel():
    return loaded(native_decode_kernel())


def _segment(kv_len: int, rows: int, kv_start: int, kv_lo: int, num_pages: int, ps: int,
             g: torch.Generator) -> PrefillSegment:
    """The last ``rows`` tokens of a sequence whose keys from ``kv_start`` lie on random pages."""
    count = -(-(kv_len - kv_start) // ps)
    pages = torch.randperm(num_pages, generator=g)[:count]
    return PrefillSegment(q_start=0, q_len=rows, kv_len=kv_len, pages=pages, kv_start=kv_start, kv_lo=kv_lo)


def _as_span(seg: PrefillSegment, ps: int) -> ForwardBatch:
    n = seg.q_len
    return ForwardBatch(input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(seg.kv_len - n, seg.kv_len),
                        slot_mapping=torch.zeros(n, dtype=torch.long), page_size=ps, num_decodes=0,
                        decode_pages=None, decode_kv_lens=None, prefills=[seg], logits_indices=torch.tensor([n - 1]))


def _as_decodes(seg: PrefillSegment, ps: int) -> ForwardBatch:
    """The segment's tokens as decode rows, row r ending at position kv_len - q_len + r."""
    n = seg.q_len
    lens = torch.arange(seg.kv_len - n + 1, seg.kv_len + 1)
    return ForwardBatch(input_ids=torch.zeros(n, dtype=torch.long), positions=lens - 1,
                        slot_mapping=torch.zeros(n, dtype=torch.long), page_size=ps, num_decodes=n,
                        decode_pages=seg.pages[None].expand(n, -1).contiguous(), decode_kv_lens=lens,
                        prefills=[], logits_indices=torch.arange(n),
                        decode_kv_start=torch.full((n,), seg.kv_start) if seg.kv_start else None,
                        decode_kv_lo=torch.full((n,), seg.kv_lo) if seg.kv_lo > 0 else None)


CASES = [  # kv_len, window, kv_start, kv_lo
    (40, None, 0, 0),
    (700, None, 0, 0),  # rows' keys in three chunks of kSplit, merged
    (530, 300, 0, 0),  # a window: each row's chunks and blocks start at its own first key
    (60, 7, 0, 0),  # a window shorter than the span
    (300, 12, 272, 280),  # ring view: the table starts at 272, nothing valid below 280
    (600, None, 256, 300),  # ring view with every key since kv_lo visible
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("kv_len,window,kv_start,kv_lo", CASES)
@pytest.mark.parametrize("ps", [4, 16])
def test_span_rows_equal_decode_rows_bitwise(kernel, dtype, hq, hkv, kv_len, window, kv_start, kv_lo, ps):
    g = torch.Generator().manual_seed(kv_len + hq + ps)
    D, num_pages = 64, 200
    k_cache = torch.randn(num_pages, ps, hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, ps, hkv, D, generator=g).to(dtype)
    for rows in range(1, SPAN_AS_DECODES + 1):
        seg = _segment(kv_len, rows, kv_start, kv_lo, num_pages, ps, g)
        q = torch.randn(rows, hq, D, generator=g).to(dtype)
        got = paged_attention(q, q, q, k_cache, v_cache, _as_span(seg, ps), D ** -0.5, window)
        want = native_decode(q, k_cache, v_cache, _as_decodes(seg, ps), D ** -0.5, window)
        assert got.dtype == dtype and torch.equal(got, want), f"{rows} rows"


@pytest.mark.parametrize("dim", [20, 72])  # not a multiple of 8 / a 64-wide block plus 8
def test_head_dims_off_the_vector_width(kernel, dim):
    g = torch.Generator().manual_seed(dim)
    k, v = torch.randn(120, 4, 2, dim, generator=g), torch.randn(120, 4, 2, dim, generator=g)
    seg = _segment(300, 9, 0, 0, 120, 4, g)
    q = torch.randn(9, 6, dim, generator=g)
    assert torch.equal(paged_attention(q, q, q, k, v, _as_span(seg, 4), 0.1, None),
                       native_decode(q, k, v, _as_decodes(seg, 4), 0.1, None))


def test_values_inside_keys_mla(kernel):
    g = torch.Generator().manual_seed(2)
    r, rope = 32, 8
    cache = torch.randn(80, 4, 1, r + rope, generator=g).to(torch.bfloat16)
    seg = _segment(290, 5, 0, 0, 80, 4, g)
    q = torch.randn(5, 16, r + rope, generator=g).to(torch.bfloat16)
    got = paged_attention(q, q, q, cache, cache[..., :r], _as_span(seg, 4), 0.15, None)
    assert got.shape == (5, 16, r)
    assert torch.equal(got, native_decode(q, cache, cache[..., :r], _as_decodes(seg, 4), 0.15, None))


@pytest.mark.parametrize("kv_len", [300, 2700])  # 300: two chunks per head, rows split among threads
def test_same_bits_on_any_thread_count(kernel, threads, kv_len):
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(300, 16, 3, 64, generator=g), torch.randn(300, 16, 3, 64, generator=g)
    seg = _segment(kv_len, 9, 0, 0, 300, 16, g)
    q = torch.randn(9, 9, 64, generator=g)
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(paged_attention(q, q, q, k_cache, v_cache, _as_span(seg, 16), 0.125, None))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], native_decode(q, k_cache, v_cache, _as_decodes(seg, 16), 0.125, None))


def test_bad_page_table_is_an_error(kernel):
    k = torch.randn(8, 4, 2, 16)
    q = torch.randn(3, 4, 16)
    seg = PrefillSegment(q_start=0, q_len=3, kv_len=13, pages=torch.tensor([1, 2]))  # 13 keys, 2 pages of 4
    with pytest.raises(RuntimeError, match="page table"):
        paged_attention(q, q, q, k, k, _as_span(seg, 4), 0.25, None)
    seg = PrefillSegment(q_start=0, q_len=3, kv_len=7, pages=torch.tensor([1, 99]))
    with pytest.raises(RuntimeError, match="page id out of range"):
        paged_attention(q, q, q, k, k, _as_span(seg, 4), 0.25, None)
