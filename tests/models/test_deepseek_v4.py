"""DeepSeek-V4 (sliding window + CSA/HCA compressed KV, mHC, hash/top-k MoE) against transformers."""

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from model_check import check_against_hf, random_ids, randomize_

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
# The tiny config, except index_n_heads=8 (not 2): with 2 heads the indexer's
# sum_h w_h relu(q_h . k) is exactly 0 for about a quarter of the entries, so top-k picks among
# ties, which is implementation-defined (transformers' own cached decode then differs from its
# prefill by 0.38 in the logits).
TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, index_n_heads=8, index_head_dim=16, index_topk=4,
            sliding_window=8,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=3,
            max_position_embeddings=512, num_nextn_predict_layers=0)


def tiny_v4_config(**overrides):
    cfg = DeepseekV4Config(**{**TINY, **overrides})
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    return cfg


def tiny_v4(seed=0, **overrides):
    cfg = tiny_v4_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:  # hash routing table: random distinct experts per token
        if layer.mlp.is_hash:
            table = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(-1)
            layer.mlp.gate.tid2eid.copy_(table[:, : cfg.num_experts_per_tok])
    return model


PROMPT = random_ids(37, 256, 1)
OTHER = random_ids(13, 256, 2)


def test_v4_matches_transformers():
    model = tiny_v4()
    diffs = check_against_hf(model, PROMPT, [5, 15, 17], OTHER, decode=6)
    assert max(diffs.values()) <= TOL, diffs
