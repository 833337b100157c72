"""Batched paged decode attention against a per-sequence float64 reference (each sequence's own
keys in position order, softmax over exactly its valid window), for GQA, windows, sinks, softcap
and MLA's values-inside-keys cache."""

import math

import pytest
import torch

from deepinfer.forward_batch import ForwardBatch, Workspace
from deepinfer.layers.attention import decode_attention

PS = 4


def _batch(lens: list[int], num_pages: int, workspace: Workspace | None = None,
           backend: str = "auto") -> ForwardBatch:
    g = torch.Generator().manual_seed(1)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # pages scattered, 0 is padding
    width = max(-(-n // PS) for n in lens)
    tables = []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // PS))]
        tables.append(own + [0] * (width - len(own)))
    return ForwardBatch(input_ids=torch.zeros(len(lens), dtype=torch.long),
                        positions=torch.tensor(lens) - 1, slot_mapping=torch.zeros(len(lens)),
                        page_size=PS, num_decodes=len(lens), decode_pages=torch.tensor(tables),
                        decode_kv_lens=torch.tensor(lens), prefills=[], logits_indices=torch.arange(len(lens)),
                        workspace=workspace or Workspace(), attention_backend=backend)


def _reference(q, k_cache, v_cache, batch, scale, window=None, softcap=None, sinks=None):
    out = []
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    for b, n in enumerate(batch.decode_kv_lens.tolist()):
        pages = batch.decode_pages[b, : -(-n // PS)]
        k = k_cache[pages].flatten(0, 1)[:n].double()  # [n, Hkv, D]
        v = v_cache[pages].flatten(0, 1)[:n].double()
        lo = 0 if window is None else max(0, n - window)
        k, v = k[lo:].repeat_interleave(Hq // Hkv, 1), v[lo:].repeat_interleave(Hq // Hkv, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat((s, sinks.double()[:, None]), dim=1)
        p = torch.softmax(s, dim=1)[:, : k.shape[0]]
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("window,softcap,with_sinks", [(None, None, False), (5, None, False),
                                                        (None, 30.0, False), (6, None, True)])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_decode_attention_matches_per_sequence_reference(window, softcap, with_sinks, backend):
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, num_pages = 6, 2, 8, 40
    lens = [9, 1, 16, 13]  # ragged: padded rows are masked
    batch = _batch(lens, num_pages, backend=backend)
    k_cache = torch.randn(num_pages, PS, Hkv, D, generator=g)
    v_cache = torch.randn(num_pages, PS, Hkv, D, generator=g)
    q = torch.randn(len(lens), Hq, D, generator=g)
    sinks = torch.randn(Hq, generator=g) if with_sinks else None
    scale = D ** -0.5
    got = decode_attention(q, k_cache, v_cache, batch, scale, window, softcap, sinks)
    want = _reference(q, k_cache, v_cache, batch, scale, window, softcap, sinks)
    assert got.shape == (len(lens), Hq, D)
    assert (got.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mla_values_are_a_slice_of_the_cached_keys(backend):
    g = torch.Generator().manual_seed(2)
    H, r, rope, num_pages = 4, 8, 4, 20
    cache = torch.randn(num_pages, PS, 1, r + rope, generator=g)
    batch = _batch([7, 12], num_pages, backend=backend)
    q = torch.randn(2, H, r + rope, generator=g)
    scale = 1 / math.sqrt(r + rope)
    got = decode_attention(q, cache, cache[..., :r], batch, scale)
    want = _reference(q, cache, cache[..., :r], batch, scale)
    assert got.shape == (2, H, r)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_layers_of_a_step_gather_into_one_workspace():
    """No per-layer allocation on the torch path: every layer's decode K/V land in the same
    buffers, and the row index is built once per step."""
    g = torch.Generator().manual_seed(3)
    ws = Workspace()
    batch = _batch([5, 11], 16, ws, backend="torch")
    caches = [torch.randn(16, PS, 2, 8, generator=g) for _ in range(2)]
    q = torch.randn(2, 4, 8, generator=g)
    decode_attention(q, caches[0], caches[1], batch, 0.3)
    ptr = ws.get("k", (1,), caches[0]).data_ptr(), ws.get("v", (1,), caches[0]).data_ptr()
    rows = batch.decode_rows(2)
    for c in reversed(caches):  # another layer, same step
        decode_attention(q, c, c, batch, 0.3)
    assert batch.decode_rows(2) is rows
    assert (ws.get("k", (1,), caches[0]).data_ptr(), ws.get("v", (1,), caches[0]).data_ptr()) == ptr
