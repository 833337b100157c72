"""DeepSeek-V2/V3 (MLA + MoE) against transformers, the latent-only KV layout, MoE statistics."""

import re

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from deepinfer.kv.pool import PagePool
from model_check import (check_against_hf, make_runner, random_ids, randomize_, run_prompt_logits,
                         new_request, prefill, decode_steps, hf_logits)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DIMS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
            v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
            first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_v3(q_lora_rank, rope_parameters, seed=0):
    cfg = DeepseekV3Config(**DIMS, num_key_value_heads=4, n_shared_experts=1, routed_scaling_factor=2.5,
                           q_lora_rank=q_lora_rank, n_group=4, topk_group=2, norm_topk_prob=True,
                           rope_parameters=rope_parameters)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_(model, seed)  # also draws e_score_correction_bias around 0
    return model


def tiny_v2(q_lora_rank, topk_method, seed=0):
    cfg = DeepseekV2Config(**DIMS, n_shared_experts=2, routed_scaling_factor=1.5, q_lora_rank=q_lora_rank,
                           n_group=4, topk_group=2, topk_method=topk_method,
                           rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(cfg).eval()
    randomize_(model, seed)
    return model


PROMPT = random_ids(37, 300, 1)
OTHER = random_ids(13, 300, 2)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
@pytest.mark.parametrize("rope", [None, YARN], ids=["rope", "yarn"])
def test_v3_matches_transformers(q_lora_rank, rope):
    model = tiny_v3(q_lora_rank, rope)
    diffs = check_against_hf(model, PROMPT, [5, 15, 17], OTHER, decode=4)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("q_lora_rank,method", [(None, "greedy"), (24, "group_limited_greedy")])
def test_v2_matches_transformers(q_lora_rank, method):
    model = tiny_v2(q_lora_rank, method)
    diffs = check_against_hf(model, PROMPT, [20, 17], OTHER, decode=3)
    assert max(diffs.values()) <= TOL, diffs


def test_yarn_mscale_matters():
    """The softmax-scale mscale correction is load-bearing: leaving it out breaks the match."""
    import deepinfer.models.deepseek_v3 as ds

    model = tiny_v3(24, YARN)
    ref = hf_logits(model, PROMPT)
    orig = ds.yarn_softmax_scale
    try:
        ds.yarn_softmax_scale = lambda config, head_dim: head_dim ** -0.5
        wrong = run_prompt_logits(make_runner(model), PROMPT)
    finally:
        ds.yarn_softmax_scale = orig
    assert (wrong - ref).abs().max() > 1e-3


def test_mla_caches_only_the_latent():
    model = tiny_v3(24, YARN)
    cfg = model.config
    runner = make_runner(model, page_size=4, num_pages=32)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert len(runner.pool.buffers) == cfg.num_hidden_layers
    for spec, layer in zip(runner.specs, runner.pool.buffers):
        assert spec.components == (("kv", (1, width)),) and spec.owns_cache
        assert list(layer) == ["kv"] and layer["kv"].shape == (32, 4, 1, width)
    per_page = PagePool.bytes_per_page(runner.specs, 4, torch.float32)
    assert per_page == cfg.num_hidden_layers * 4 * width * 4
    assert sum(b.numel() * b.element_size() for b in runner.pool.owned_buffers()) == 32 * per_page


def test_moe_stats_count_routed_tokens():
    model = tiny_v3(None, None)
    cfg = model.config
    runner = make_runner(model)
    m = runner.model
    assert m.moe_stats()["layers"].keys() == set(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    a = new_request(runner, PROMPT, "a")
    la = prefill(runner, a, [20, 17])
    stats = m.moe_stats()
    assert stats["num_experts"] == 8 and stats["top_k"] == 3
    for layer in stats["layers"].values():
        assert sum(layer["last"]) == 17 * 3  # the latest step: the second chunk
        assert sum(layer["total"]) == 37 * 3 and layer["steps"] == 2
        assert len(layer["last"]) == 8
    b = new_request(runner, OTHER, "b")
    lb = prefill(runner, b, None)
    decode_steps(runner, [a, b], [la[-1], lb[-1]], 2)
    for layer in m.moe_stats()["layers"].values():
        assert sum(layer["last"]) == 2 * 3  # one batched decode step of two sequences
        assert sum(layer["total"]) == (37 + 13 + 2 * 2) * 3
    m.reset_moe_stats()
    assert all(sum(v["total"]) == 0 for v in m.moe_stats()["layers"].values())


def per_expert_checkpoint(state_dict, extra_layer):
    """The on-disk naming: one tensor per expert and projection (plus an MTP layer to ignore)."""
    out = {}
    for name, t in state_dict.items():
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m:
            out[name] = t
        elif m.group(2) == "down_proj":
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
        else:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inter:]
    out[f"model.layers.{extra_layer}.embed_tokens.weight"] = torch.zeros(3)
    out[f"model.layers.{extra_layer}.mlp.experts.0.gate_proj.weight"] = torch.zeros(3)
    return out


def test_loads_per_expert_checkpoint_names():
    model = tiny_v3(24, None)
    sd = per_expert_checkpoint(model.state_dict(), model.config.num_hidden_layers)
    ours = run_prompt_logits(make_runner(model, state_dict=sd), PROMPT)
    assert (ours - hf_logits(model, PROMPT)).abs().max() <= TOL
