"""The native CPU paged decode attention (``layers/native_decode.py``) against the torch path
(gather + SDPA) and a dense float64 reference per sequence: batch 1 and 5, ragged contexts,
windows, ring views (``kv_start`` / ``kv_lo``), GQA ratios 1/3/8, fp32 and bf16, MLA's values
inside keys; thread-count invariance; where it does not apply, and the fallback when disabled."""

from __future__ import annotations

import pytest
import torch

from deepinfer import native_build
from deepinfer.forward_batch import ForwardBatch
from deepinfer.layers import native_decode
from deepinfer.layers.attention import decode_attention
from deepinfer.layers.native_decode import decode_backend, native_decode_kernel
from native_helpers import loaded


@pytest.fixture(scope="module")
def kernel():
    return loaded(native_decode_kernel())



def _batch(lens: list[int], num_pages: int, ps: int, backend: str, starts: list[int] | None = None,
           los: list[int] | None = None, seed: int = 0) -> ForwardBatch:
    """Decode rows whose keys from ``starts[b]`` (0: the whole sequence) up to ``lens[b]`` lie on
    scattered pages; page 0 pads the tables."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    starts = starts or [0] * len(lens)
    counts = [-(-(n - s) // ps) for n, s in zip(lens, starts)]
    tables = []
    for c in counts:
        own = [perm.pop() for _ in range(c)]
        tables.append(own + [0] * (max(counts) - c))
    as_row = (lambda xs: None if xs is None else torch.tensor(xs))
    return ForwardBatch(input_ids=torch.zeros(len(lens), dtype=torch.long), positions=torch.tensor(lens) - 1,
                        slot_mapping=torch.zeros(len(lens), dtype=torch.long), page_size=ps,
                        num_decodes=len(lens), decode_pages=torch.tensor(tables), decode_kv_lens=torch.tensor(lens),
                        prefills=[], logits_indices=torch.arange(len(lens)),
                        decode_kv_start=as_row(None if not any(starts) else starts), decode_kv_lo=as_row(los),
                        attention_backend=backend)


def _dense(q, k_cache, v_cache, batch, scale, window=None):
    """Each row's visible keys in position order, softmax in float64."""
    out = []
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    for b, n in enumerate(batch.decode_kv_lens.tolist()):
        first = 0 if batch.decode_kv_start is None else int(batch.decode_kv_start[b])
        lo = max(first, 0 if batch.decode_kv_lo is None else int(batch.decode_kv_lo[b]),
                 0 if window is None else n - window)
        pages = batch.decode_pages[b]
        k = k_cache[pages].flatten(0, 1)[lo - first : n - first].double()
        v = v_cache[pages].flatten(0, 1)[lo - first : n - first].double()
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


CASES = [  # lens, window, ring starts, ring lows
    ([37], None, None, None),
    ([1], None, None, None),
    ([700], None, None, None),  # more than one split of keys, merged
    ([9, 1, 16, 40, 613], None, None, None),
    ([9, 1, 16, 40, 613], 7, None, None),
    ([30, 50, 21, 8, 300], 12, [16, 32, 0, 0, 272], [20, 32, 0, 3, 280]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("lens,window,starts,los", CASES)
@pytest.mark.parametrize("ps", [4, 16])
def test_matches_torch_path_and_dense_reference(kernel, dtype, hq, hkv, lens, window, starts, los, ps):
    g = torch.Generator().manual_seed(len(lens) + hq + ps)
    D, num_pages = 64, 200 if ps == 4 else 60
    k_cache = torch.randn(num_pages, ps, hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, ps, hkv, D, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, D, generator=g).to(dtype)
    scale = D ** -0.5
    native = _batch(lens, num_pages, ps, "auto", starts, los)
    torch_path = _batch(lens, num_pages, ps, "torch", starts, los)
    assert decode_backend(q, k_cache, v_cache, native, None, None) == "native"
    got = decode_attention(q, k_cache, v_cache, native, scale, window)
    ref = decode_attention(q, k_cache, v_cache, torch_path, scale, window)
    want = _dense(q, k_cache, v_cache, native, scale, window)
    assert got.dtype == dtype and got.shape == (len(lens), hq, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output
    assert (got.double() - want).abs().max().item() < tol
    assert (got.double() - ref.double()).abs().max().item() < tol


def test_values_inside_keys_mla(kernel):
    g = torch.Generator().manual_seed(2)
    H, r, rope, num_pages, ps = 16, 32, 8, 40, 4
    cache = torch.randn(num_pages, ps, 1, r + rope, generator=g)
    batch = _batch([7, 12, 90], num_pages, ps, "auto")
    q = torch.randn(3, H, r + rope, generator=g)
    scale = (r + rope) ** -0.5
    assert decode_backend(q, cache, cache[..., :r], batch, None, None) == "native"
    got = decode_attention(q, cache, cache[..., :r], batch, scale)
    assert got.shape == (3, H, r)
    assert (got.double() - _dense(q, cache, cache[..., :r], batch, scale)).abs().max().item() < 1e-5


@pytest.mark.parametrize("dim", [20, 72])  # not a multiple of 8 / a 64-wide block plus 8
def test_head_dims_off_the_vector_width(kernel, dim):
    g = torch.Generator().manual_seed(dim)
    k, v = torch.randn(40, 4, 2, dim, generator=g), torch.randn(40, 4, 2, dim, generator=g)
    q = torch.randn(3, 6, dim, generator=g)
    batch = _batch([5, 41, 77], 40, 4, "auto")
    got = decode_attention(q, k, v, batch, dim ** -0.5)
    assert (got.double() - _dense(q, k, v, batch, dim ** -0.5)).abs().max().item() < 1e-5


def test_same_bits_on_any_thread_count(kernel, threads):
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(300, 16, 3, 64, generator=g), torch.randn(300, 16, 3, 64, generator=g)
    q = torch.randn(5, 9, 64, generator=g)
    batch = _batch([2700, 5, 900, 333, 17], 300, 16, "auto")
    outs = []
    for n in (1, 2, 3):
        threads(n)
        outs.append(decode_attention(q, k_cache, v_cache, batch, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_chunk_several_and_none_in_one_batch(kernel, dtype):
    """A row of one chunk is written by its item, the others by the merge pass (a row with no
    visible key: zeros); each row gets the bits it gets in a batch of its own."""
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(120, 16, 3, 64, generator=g).to(dtype) for _ in range(2))
    lens, los = [40, 700, 9, 300], [40, 0, 0, 0]  # row 0 sees no key (kv_lo = its length)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    batch = _batch(lens, 120, 16, "auto", los=los)
    got = decode_attention(q, k_cache, v_cache, batch, 0.125)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    for b in range(1, len(lens)):
        alone = _batch(lens, 120, 16, "auto", los=los)
        for name in ("decode_pages", "decode_kv_lens", "decode_kv_lo"):
            setattr(alone, name, getattr(alone, name)[b : b + 1].contiguous())
        alone.num_decodes = 1
        assert torch.equal(got[b], decode_attention(q[b : b + 1], k_cache, v_cache, alone, 0.125)[0])


def test_torch_path_where_the_kernel_does_not_apply(kernel):
    k = torch.randn(8, 4, 2, 16)
    q = torch.randn(1, 4, 16)
    batch = _batch([5], 8, 4, "auto")
    assert decode_backend(q, k, k, batch, 30.0, None) == "torch"  # softcap
    assert decode_backend(q, k, k, batch, None, torch.zeros(4)) == "torch"  # sinks
    assert decode_backend(q.half(), k.half(), k.half(), batch, None, None) == "torch"  # dtype
    assert decode_backend(q, k, k, _batch([5], 8, 4, "torch"), None, None) == "torch"  # asked


def test_bad_page_table_is_an_error(kernel):
    k = torch.randn(8, 4, 2, 16)
    batch = _batch([5], 8, 4, "auto")
    batch.decode_kv_lens = torch.tensor([13])  # 13 keys, 2 pages of 4
    with pytest.raises(RuntimeError, match="page table"):
        decode_attention(torch.randn(1, 4, 16), k, k, batch, 0.25)
    batch = _batch([5], 8, 4, "auto")
    batch.decode_pages[0, 0] = 99
    with pytest.raises(RuntimeError, match="page id out of range"):
        decode_attention(torch.randn(1, 4, 16), k, k, batch, 0.25)


def test_disabled_kernel_falls_back_to_torch(monkeypatch):
    native_decode_kernel.cache_clear()
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    try:
        assert not native_decode.native_decode_kernel().loaded
        g = torch.Generator().manual_seed(4)
        k, v, q = (torch.randn(20, 4, 2, 16, generator=g), torch.randn(20, 4, 2, 16, generator=g),
                   torch.randn(2, 6, 16, generator=g))
        batch = _batch([9, 30], 20, 4, "auto")
        assert decode_backend(q, k, v, batch, None, None) == "torch"
        got = decode_attention(q, k, v, batch, 0.25)
        assert (got.double() - _dense(q, k, v, batch, 0.25)).abs().max().item() < 1e-5
    finally:
        monkeypatch.undo()
        native_decode_kernel.cache_clear()


@pytest.mark.parametrize("model", ["llama", "sliding"])
def test_engine_greedy_identical_to_torch_path(kernel, tmp_path_factory, model):
    from tiny_checkpoints import make_checkpoint, tiny_llama_config

    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    extra = {} if model == "llama" else {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    path = make_checkpoint(tmp_path_factory.mktemp(model), tiny_llama_config(**extra))
    prompts = [[1, 5, 9, 12], [7, 3, 3, 100, 200] * 5, list(range(2, 60))]
    outs = []
    for backend in ("auto", "torch"):
        llm = LLM(str(path), attention_backend=backend, progress=False, host_cache_gb=0, enable_disk_cache=False,
                  page_size=4)
        outs.append([o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))])
    assert outs[0] == outs[1]
