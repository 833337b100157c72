"""Attention over the paged KV pool, for any mix of decodes and (chunked, prefix-cached) prefills.

Caches are per-layer tensors ``[num_pages, page_size, kv_heads, dim]``. A step first writes
the new tokens' K/V into their slots, then each query attends over the pages of its own
sequence. Decodes are batched: one ``index_select`` per cache, with row indices the batch
builds once per step for all layers, copies every decode's keys straight into the
``[B, kv_heads, L, dim]`` layout attention reads (padded, masked), in a workspace reused by
every layer; on the SDPA path the query heads sharing a KV head are folded into the
query-length dimension, so grouped-query attention needs no repeated K/V. On the CPU our native
kernel (``native_decode.py``) replaces that gather and SDPA: it reads the pages in place. Each
prefill chunk runs on its own so its causal mask can start mid-sequence; on CPU a chunk after
cached keys needs no mask at all (``chunk_attention.py``), and where our prefill kernel runs
(``native_prefill.py``) one call reads a chunk's cached and own keys in place instead. Apart from
the native kernels, plain torch ops: runs on CPU and CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forward_batch import ForwardBatch
from .chunk_attention import prefix_then_causal, splits_at_prefix
from .native_decode import decode_backend, native_decode, span_rows
from .native_ops import small_ops_apply
from .native_prefill import native_prefill, prefill_backend
from .rotary import RotaryEmbedding


def store_kv(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' entries ``x`` [T, heads, dim] into their slots of ``cache``: one native
    row copy per token and head where the small ops apply (``index_copy_`` goes element by
    element), else ``index_copy_``."""
    if _stores_natively(cache, x):
        torch.ops.deepinfer_ops.store_rows(cache, x, slot_mapping.contiguous())
        return
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def _stores_natively(cache: torch.Tensor, x: torch.Tensor) -> bool:
    return x.dim() == 3 and cache.dim() == 4 and x.dtype == cache.dtype and x.stride(2) == 1 \
        and cache.stride(3) == 1 and small_ops_apply(x)


def rotate_and_store(rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotary(q), rotary(k))``, with the rotated k and v stored into their slots: one native
    call where the rotary and both stores run natively (a layer's four calls cost their dispatch
    more than their work), else those four."""
    if q.dtype == k.dtype and rotary.native(positions, q) and rotary.native(positions, k) \
            and _stores_natively(k_cache, k) and _stores_natively(v_cache, v):
        return torch.ops.deepinfer_ops.rotate_store.default(q, k, v, rotary.cos, rotary.sin, positions.contiguous(),
                                                            k_cache, v_cache, slot_mapping.contiguous())
    q, k = rotary(positions, q), rotary(positions, k)
    store_kv(k_cache, k, slot_mapping)
    store_kv(v_cache, v, slot_mapping)
    return q, k


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pages [P] -> contiguous tokens [P * page_size, heads, dim] (``index_select`` copies whole
    pages; advanced indexing would copy element by element)."""
    return cache.index_select(0, pages).flatten(0, 1)


def _v_in_k(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """V is a leading slice of K's own storage (MLA: values are the latent part of the cached
    ``[latent, k_pe]``): gather once and slice."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[:-1] == k_cache.shape[:-1]
            and v_cache.stride()[:-1] == k_cache.stride()[:-1])


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
               pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = gather_pages(k_cache, pages)
    if _v_in_k(k_cache, v_cache):
        return k, k[..., : v_cache.shape[-1]]
    return k, gather_pages(v_cache, pages)


def _gather_decode(cache: torch.Tensor, batch: ForwardBatch, name: str) -> torch.Tensor:
    """Every decode's keys (or values) of ``cache`` as ``[B, kv_heads, L, dim]``, in the workspace."""
    heads, dim = cache.shape[2], cache.shape[3]
    rows = batch.decode_rows(heads)
    B = batch.num_decodes
    out = batch.workspace.get(name, (rows.numel(), dim), cache)
    torch.index_select(cache.view(-1, dim), 0, rows, out=out)
    return out.view(B, heads, -1, dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: ForwardBatch, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] of the batch's decodes -> [B, Hq, Dv]: read in place by the native kernel
    where it applies (``native_decode.decode_backend``), else over their gathered pages."""
    if decode_backend(q, k_cache, v_cache, batch, softcap, sinks) == "native":
        return native_decode(q, k_cache, v_cache, batch, scale, window)
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    k = _gather_decode(k_cache, batch, "k")
    v = k[..., : v_cache.shape[-1]] if _v_in_k(k_cache, v_cache) else _gather_decode(v_cache, batch, "v")
    mask = batch.decode_mask(window)
    if softcap is not None or sinks is not None:  # the explicit path (repeats K/V per head group)
        return attend(q.unsqueeze(2), k, v, mask, scale, softcap=softcap, sinks=sinks).squeeze(2)
    # Query heads of one KV head (head h serves q heads h*G .. h*G+G-1) act as G query rows.
    o = attend(q.view(B, Hkv, Hq // Hkv, D), k, v, mask, scale)
    return o.reshape(B, Hq, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, causal: bool = False, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D*] -> [B, Hq, Lq, Dv]; GQA by head groups."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a learned per-head logit that absorbs probability mass
        sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


# A chunk this short (a verify span, a short tail) runs through the decode kernel's span variant
# (``native_decode.span_rows``), so each row gets the bits a decode at its position gets:
# speculative greedy output then equals plain greedy output in bf16 too (the small-row linears
# keep the other ops' bits for 1-16 rows).
SPAN_AS_DECODES = 16


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k_new/v_new: this step's K/V (already stored). Returns [T, Hq, Dv]."""
    nd = batch.num_decodes
    if nd and nd == q.shape[0]:  # decodes only: no output buffer to copy them into
        return decode_attention(q, k_cache, v_cache, batch, scale, window, softcap, sinks)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, batch, scale, window, softcap, sinks)
    for i, seg in enumerate(batch.prefills):
        sl = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.q_len <= SPAN_AS_DECODES and \
                decode_backend(q, k_cache, v_cache, batch, softcap, sinks) == "native":
            out[sl] = span_rows(q[sl], k_cache, v_cache, seg, scale, window)
            continue
        qh = q[sl].transpose(0, 1)[None]
        # every earlier key visible (no window, not a ring view), plain softmax
        plain = window is None and seg.kv_start == 0 and seg.kv_lo <= 0 and softcap is None and sinks is None
        prefix = seg.kv_len - seg.q_len
        if plain and splits_at_prefix(q, v_new) and \
                prefill_backend(q, k_cache, v_cache, batch.attention_backend) == "native":
            out[sl] = native_prefill(q[sl], k_cache, v_cache, seg.pages, prefix, scale)
            continue
        if not prefix:  # nothing cached before this chunk: use K/V as computed
            k, v = k_new[sl], v_new[sl]
        else:
            k, v = _gather_kv(k_cache, v_cache, seg.pages)
            k, v = k[: seg.kv_len - seg.kv_start], v[: seg.kv_len - seg.kv_start]
            if plain and splits_at_prefix(q, v):
                o = prefix_then_causal(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       seg.kv_len - seg.q_len, scale)
                out[sl] = o[0].transpose(0, 1)
                continue
        mask = batch.prefill_mask(i, window)
        o = attend(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   mask, scale, causal=mask is None, softcap=softcap, sinks=sinks)
        out[sl] = o[0].transpose(0, 1)
    return out
