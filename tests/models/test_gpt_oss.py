"""gpt-oss: alternating sliding/full layers with attention sinks, top-k softmax MoE."""

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from model_check import check_against_hf, make_runner, new_request, prefill, random_ids, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
PROMPT = random_ids(37, 300, 1)
OTHER = random_ids(13, 300, 2)


def tiny_gpt_oss():
    cfg = GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, swiglu_limit=1.0,  # low clamp so it is exercised
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    cfg.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    randomize_(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    return model


def test_matches_transformers():
    model = tiny_gpt_oss()
    diffs = check_against_hf(model, PROMPT, [5, 15, 17], OTHER, decode=6)
    assert max(diffs.values()) <= TOL, diffs


def test_layout_and_moe_stats():
    runner = make_runner(tiny_gpt_oss())
    assert [s.window for s in runner.specs] == [8, None, 8, None]
    req = new_request(runner, PROMPT)
    prefill(runner, req, [20, 17])
    stats = runner.model.moe_stats()
    assert sorted(stats["layers"]) == [0, 1, 2, 3]
    for layer in stats["layers"].values():
        assert sum(layer["last"]) == 17 * 2 and sum(layer["total"]) == 37 * 2
