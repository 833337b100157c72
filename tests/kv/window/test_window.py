"""Sliding-window rings (kv/window/): the window group of a layout, ring allocation, the ring
view's masks, snapshots' LRU, and sliding-layer memory staying O(window) in a long generation."""

import random

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.kv.layout import KVSpec
from deepinfer.kv.window.layout import WindowLayout
from deepinfer.kv.window.pool import WindowPool
from deepinfer.kv.window.rings import RingAllocator, RingState
from deepinfer.kv.window.snapshots import WindowSnapshot, WindowSnapshotStore
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from tiny_checkpoints import make_checkpoint

GQA = KVSpec.gqa(2, 16)


def sliding(w, share=None):
    return KVSpec.gqa(2, 16, window=w, share_with=share)


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ layout


def test_layout_groups_window_layers_and_sums_the_exact_replay():
    specs = [sliding(8), sliding(8), GQA, sliding(8)]
    lay = WindowLayout.from_specs(specs)
    assert lay.layers == {0, 1, 3} and lay.owners == (0, 1, 3) and lay.window == 8
    assert lay.replay_tokens == 3 * 7
    page = lay.page_specs(specs)
    assert [s.components for s in page] == [(), (), GQA.components, ()]
    assert [s.window for s in page] == [8, 8, None, 8]
    assert WindowLayout.from_specs([GQA, GQA]) is None
    # ring: the window before a chunk plus the chunk; a decode spans ceil((W-1)/ps) + 1 pages
    assert lay.chunk_tokens(4, 2048) == 8 and lay.chunk_tokens(16, 2048) == 16
    assert lay.chunk_tokens(4, 2048, requested=100) == 100 and lay.chunk_tokens(4, 64, 100) == 64
    assert lay.ring_pages(4, 8) == 5 and lay.decode_pages(4) == 3


def test_layout_with_cross_layer_sharing():
    # a window layer reading a full layer's cache stays paged; a full layer reading a window
    # layer's cache keeps that cache paged (it needs every token)
    specs = [GQA, sliding(8, share=0), sliding(8), KVSpec.gqa(2, 16, share_with=2), sliding(4),
             sliding(6, share=4)]
    lay = WindowLayout.from_specs(specs)
    assert lay.owners == (4,) and lay.layers == {4, 5} and lay.window == 6
    assert lay.replay_tokens == 3 + 5


# ------------------------------------------------------------------------------ rings


def test_ring_allocator_grows_lazily_then_wraps():
    rings = RingAllocator(num_pages=1 + 2 * 5, ring_pages=5, page_size=4)
    a, b = RingState(), RingState()
    assert rings.ensure(a, 6) and len(a.pages) == 2
    assert rings.ensure(a, 1000) and len(a.pages) == 5 and rings.in_use == 5
    assert rings.ensure(b, 20) and not rings.ensure(RingState(), 1)  # pool exhausted
    assert rings.page(a, 7) == a.pages[2] and rings.page(a, -1) == 0
    assert rings.page(RingState(pages=[9]), 3) == 0  # a slot never allocated: padding
    rings.free(a)
    assert a.pages == [] and rings.in_use == 5


def test_ring_shrink_gives_back_only_pages_past_the_kept_positions():
    rings = RingAllocator(num_pages=1 + 5, ring_pages=5, page_size=4)
    ring = RingState()
    assert rings.ensure(ring, 6) and rings.ensure(ring, 6 + 9)  # a verify span of 9 tokens
    assert len(ring.pages) == 4
    kept = ring.pages[:2]
    assert rings.shrink(ring, 8) == 2 and ring.pages == kept and rings.in_use == 2
    assert rings.shrink(ring, 8) == 0
    assert rings.ensure(ring, 1000) and rings.shrink(ring, 30) == 0  # a full ring wraps: kept
    assert rings.in_use == 5


def _pool(window=8, ps=4, chunk=8, seqs=2):
    spec = [sliding(window)]
    lay = WindowLayout.from_specs(spec)
    R = lay.ring_pages(ps, chunk)
    return WindowPool(spec, lay, seqs * R + 1, R, ps, torch.float32, torch.device("cpu"))


def _view(pool, items):
    decodes = [(r, n) for r, n in items if n == 1]
    prefills = [(r, n) for r, n in items if n > 1]
    segs, off = [], len(decodes)
    for r, n in prefills:
        segs.append(PrefillSegment(off, n, r.num_computed_tokens + n, torch.zeros(1, dtype=torch.long)))
        off += n
    base = ForwardBatch(input_ids=torch.zeros(off, dtype=torch.long), positions=torch.zeros(off),
                        slot_mapping=torch.zeros(off), page_size=pool.page_size,
                        num_decodes=len(decodes), decode_pages=None,
                        decode_kv_lens=torch.tensor([r.num_computed_tokens + 1 for r, _ in decodes]),
                        prefills=segs, logits_indices=torch.zeros(1))
    for r, n in items:
        assert pool.rings.ensure(r.ring, r.num_computed_tokens + n)
    return pool.view(base, decodes, prefills, chunk_limit=8)


@pytest.mark.parametrize("seed", range(4))
def test_ring_view_selects_exactly_each_querys_window(seed):
    """Walk a sequence through random chunks (decodes too), from a random valid start: every
    query's unmasked keys are exactly the window positions it may see, each read from the ring
    slot its position was written to."""
    rnd = random.Random(seed)
    W, ps = 8, 4
    pool = _pool(W, ps)
    R = pool.rings.size
    req = Request("r", list(range(200)), SamplingParams())
    lo = rnd.choice([0, 4, 12, 20])  # e.g. a replay that starts mid-sequence
    req.num_computed_tokens = lo
    req.ring = RingState(valid_from=lo)
    while req.num_computed_tokens < 120:
        n = rnd.choice([1, 1, 2, 3, 5, 8])
        c = req.num_computed_tokens
        view = _view(pool, [(req, n)])
        slot_of = {c + i: int(s) for i, s in enumerate(view.slot_mapping)}
        for p, s in slot_of.items():  # ring slot of a position: its page mod R
            assert s // ps == req.ring.pages[(p // ps) % R] and s % ps == p % ps
        if n == 1:
            mask = view.decode_mask(W)[0, 0, 0]
            keys = view.decode_kv_start[0] + torch.arange(mask.numel())
            got = [set(keys[mask].tolist())]
            tables = [view.decode_pages[0]]
        else:
            seg = view.prefills[0]
            mask = view.prefill_mask(0, W)
            keys = torch.arange(seg.kv_start, seg.kv_len)
            got = [set(keys[row].tolist()) for row in mask]
            tables = [seg.pages] * n
        for i, (seen, table) in enumerate(zip(got, tables)):
            q = c + (i if n > 1 else 0)
            assert seen == set(range(max(lo, q - W + 1), q + 1))
            start = int(view.decode_kv_start[0]) if n == 1 else view.prefills[0].kv_start
            for k in seen:  # the gathered page holding key k is the ring page it lives in
                assert int(table[(k - start) // ps]) == req.ring.pages[(k // ps) % R]
        req.num_computed_tokens += n


def test_view_rejects_a_chunk_larger_than_the_ring():
    pool = _pool()
    req = Request("r", list(range(50)), SamplingParams())
    req.ring = RingState()
    with pytest.raises(ValueError, match="window_chunk_tokens"):
        _view(pool, [(req, 9)])


# ------------------------------------------------------------------------------ snapshots


def _snap(nbytes_pages):
    return WindowSnapshot(0, [torch.zeros(nbytes_pages, 256, dtype=torch.uint8)])


def test_snapshot_store_is_an_lru_under_a_byte_budget():
    store = WindowSnapshotStore(capacity_bytes=3 * 256)
    assert store.put(b"a", _snap(1)) and store.put(b"b", _snap(1)) and store.put(b"c", _snap(1))
    assert store.get(b"a") is not None  # a is now the most recent
    assert store.put(b"d", _snap(1))  # evicts b
    assert b"b" not in store and b"a" in store and store.evicted == 1
    assert not store.put(b"e", _snap(4))  # larger than the whole budget
    assert not store.put(b"a", _snap(1))  # already there
    store.drop([b"a", b"zz"])
    assert len(store) == 2 and store.bytes == 2 * 256 and store.dropped == 1


# ------------------------------------------------------------------------------ memory


def _tiny(tmp_path_factory, name, cfg):
    cfg.architectures = [{"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}[cfg.model_type]]
    return make_checkpoint(tmp_path_factory.mktemp(name), cfg)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return _tiny(tmp_path_factory, "gemma3", Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"]))


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    return _tiny(tmp_path_factory, "mistral", MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=512))


@pytest.mark.parametrize("model", ["tiny_gemma3", "tiny_mistral"])
def test_sliding_memory_stays_at_the_ring_in_a_long_generation(model, request):
    """Two sequences generate 120 tokens with speculation on: each holds at most one ring of
    sliding-layer pages (R = ceil((W - 1 + chunk) / page_size) + 1 = 5) while its
    full-attention pages grow with it, after every step exactly those of its computed tokens
    (a verify span's pages for rejected tokens go back at once); the tokens equal those of the
    old layout, which pages every layer for every token."""
    path = request.getfixturevalue(model)
    # fixed k: every draft is verified, whatever the machine's speed (a scheduled plan is not)
    spec = SpeculativeConfig(method="ngram", num_tokens=4, scheduled=False)
    kw = dict(page_size=4, num_pages=256, max_num_batched_tokens=64, max_num_seqs=2,
              progress=False, enable_disk_cache=False, speculative_config=spec)
    llm = LLM(str(path), **kw)
    engine = llm.engine
    rings = engine.runner.window.rings
    assert rings.size == 5
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(list(range(10 + i, 30 + i)), params) for i in range(2)]
    peak_ring = peak_full = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        peak_ring = max(peak_ring, rings.in_use)
        assert rings.in_use <= len(running) * rings.size
        for r in running:
            assert len(r.ring.pages) == min(rings.size, -(-r.num_computed_tokens // 4))  # one ring
            assert len(r.pages) == -(-r.num_computed_tokens // 4)  # full group: every token
            peak_full = max(peak_full, len(r.pages))
    assert peak_ring == 2 * rings.size and rings.in_use == 0
    assert all(0 < r.spec.accepted < r.spec.verified for r in reqs)  # drafts kept and rejected
    assert peak_full == -(-(20 + 119) // 4)
    full_group = engine.runner.pool.owned_buffers()
    assert bool(full_group) == (model == "tiny_gemma3")  # Mistral: every layer slides
    if model == "tiny_mistral":
        assert engine.tiers is None  # pages hold no bytes: nothing for L2/L3 to copy
    paged = LLM(str(path), window_ring=False, **kw)
    assert paged.engine.runner.window is None
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in paged.generate(
        [list(range(10 + i, 30 + i)) for i in range(2)], params)]
