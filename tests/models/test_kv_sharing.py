"""Cross-layer KV sharing in the Llama family (no HF reference: a plain torch one is written here)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deepinfer.kv.pool import PagePool
from model_check import (decode_steps, make_runner, new_request, prefill, random_ids, randomize_,
                         run_prompt_logits)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
PROMPT = random_ids(29, 300, 1)
OTHER = random_ids(11, 300, 2)


def tiny(share=None, groups=None, qwen3=False, layers=4):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False)
    cfg = Qwen3Config(**kw, head_dim=16) if qwen3 else LlamaConfig(**kw)
    cfg.architectures = ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"]
    if share:
        cfg.cross_layer_kv_share = share
    if groups:
        cfg.kv_sharing_groups = groups
    torch.manual_seed(0)
    model = (Qwen3ForCausalLM if qwen3 else LlamaForCausalLM)(cfg).eval()
    randomize_(model)
    return model


def owners(n_layers, share=None, groups=None):
    out = list(range(n_layers))
    if groups:
        for g in groups:
            for i in g:
                out[i] = g[0]
    elif share:
        out = [i - i % share for i in range(n_layers)]
    return out


def _rope(x, cos, sin):  # x [H, L, D]; rotate halves
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@torch.no_grad()
def reference_logits(hf, ids, owner):
    """Full-sequence forward of the HF weights where layer i attends with the K/V of owner[i]."""
    cfg = hf.config
    L, H, Hkv = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    x = hf.model.embed_tokens(torch.tensor(ids))
    cos, sin = hf.model.rotary_emb(x[None], torch.arange(L)[None])
    cos, sin = cos[0], sin[0]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    kv = {}
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(L, H, D)
        if hasattr(a, "q_norm"):
            q = a.q_norm(q)
        q = _rope(q.transpose(0, 1), cos, sin)
        if owner[i] == i:
            k = a.k_proj(h).view(L, Hkv, D)
            if hasattr(a, "k_norm"):
                k = a.k_norm(k)
            kv[i] = (_rope(k.transpose(0, 1), cos, sin), a.v_proj(h).view(L, Hkv, D).transpose(0, 1))
        k, v = kv[owner[i]]
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + a.o_proj((p @ v).transpose(0, 1).reshape(L, H * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(hf.model.norm(x))


def test_reference_without_sharing_is_transformers():
    hf = tiny()
    ref = reference_logits(hf, PROMPT, owners(4))
    with torch.no_grad():
        assert (ref - hf(torch.tensor([PROMPT])).logits[0]).abs().max() <= TOL


CASES = {"share2": dict(share=2), "share3": dict(share=3), "groups": dict(groups=[[0], [1, 2, 3]]),
         "qwen3_share2": dict(share=2, qwen3=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_pool_holds_one_buffer_per_group(case):
    hf = tiny(**CASES[case])
    runner = make_runner(hf, page_size=4, num_pages=16)
    own = owners(4, CASES[case].get("share"), CASES[case].get("groups"))
    n_groups = len(set(own))
    assert [s.share_with for s in runner.specs] == [None if o == i else o for i, o in enumerate(own)]
    for i, o in enumerate(own):
        assert runner.pool.buffers[i] is runner.pool.buffers[o]
    assert len(runner.pool.owned_buffers()) == 2 * n_groups  # k and v per group
    per_page = 4 * 2 * 2 * 16 * 4  # tokens * (k, v) * kv heads * head dim * fp32
    assert PagePool.bytes_per_page(runner.specs, 4, torch.float32) == n_groups * per_page
    held = sum(b.numel() * b.element_size() for b in runner.pool.owned_buffers())
    assert held == 16 * n_groups * per_page
    # Layers reading a shared cache have no K/V projections at all.
    for i, o in enumerate(own):
        assert runner.model.model.layers[i].self_attn.qkv_proj.out_sizes == ([64] if o != i else [64, 32, 32])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_prefill_chunked_and_decode(case):
    hf = tiny(**CASES[case])
    own = owners(4, CASES[case].get("share"), CASES[case].get("groups"))
    ref = reference_logits(hf, PROMPT, own)

    one_shot = run_prompt_logits(make_runner(hf), PROMPT)
    assert (one_shot - ref).abs().max() <= TOL

    runner = make_runner(hf)
    a = new_request(runner, PROMPT, "a")
    chunked = prefill(runner, a, [6, 11, 12])
    assert (chunked - one_shot).abs().max() <= TOL  # chunked == unchunked
    assert (chunked - ref).abs().max() <= TOL

    b = new_request(runner, OTHER, "b")
    lb = prefill(runner, b, None)
    steps = decode_steps(runner, [a, b], [chunked[-1], lb[-1]], 3)
    for req, got in zip((a, b), steps):
        full = reference_logits(hf, req.all_token_ids, own)
        for i, lg in enumerate(got):
            assert (lg - full[req.num_prompt_tokens + i]).abs().max() <= TOL


def test_sharing_changes_the_output():
    """Sanity: the shared model is a different function from the unshared one."""
    hf = tiny(share=2)
    assert (reference_logits(hf, PROMPT, owners(4, 2)) - reference_logits(hf, PROMPT, owners(4))).abs().max() > 1e-2
