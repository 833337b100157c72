"""A tiny random DeepSeek-V4 checkpoint whose tokenizer holds DeepSeek's special tokens (the
ones deepseek-recipe renders: BOS/EOS, roles, ``<think>``, ``｜DSML｜``, ...), so prompts and
replies go through the recipe exactly as on the real model."""

from __future__ import annotations

from pathlib import Path

import deepseek_recipe as dr
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast

SPECIALS = [t.default_str() for t in (
    dr.SpecialToken.Bos, dr.SpecialToken.Eos, dr.SpecialToken.ThinkingStart,
    dr.SpecialToken.ThinkingEnd, dr.SpecialToken.System, dr.SpecialToken.User,
    dr.SpecialToken.Assistant, dr.SpecialToken.LatestReminder, dr.SpecialToken.Dsml,
    dr.SpecialToken.Image, dr.SpecialToken.Ref, dr.SpecialToken.RefEnd, dr.SpecialToken.Box,
    dr.SpecialToken.BoxEnd, dr.SpecialToken.Point, dr.SpecialToken.PointEnd,
    dr.SpecialToken.Polygon, dr.SpecialToken.PolygonEnd)]
BOS, EOS = SPECIALS[0], SPECIALS[1]
CORPUS = [
    "The weather in Paris is sunny. What is the weather in Rome? Let me check the tool.",
    '<invoke name="get_weather"> <parameter name="city" string="true">Paris</parameter> '
    "tool_calls tool_result Available Tool Schemas",
    '0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k l m n o p q r s t u v w x y z {"city": "Paris"}',
]


def make_deepseek_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=BOS)


def make_v4_checkpoint(path: Path, seed: int = 0) -> Path:
    """Two layers (window; CSA), vocab = the tokenizer's; random weights, larger than the
    default init so greedy replies are not constant."""
    tok = make_deepseek_tokenizer()
    cfg = DeepseekV4Config(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "moe"], hc_mult=2, hc_sinkhorn_iters=3,
        max_position_embeddings=2048, num_nextn_predict_layers=0,
        eos_token_id=tok.convert_tokens_to_ids(EOS), bos_token_id=tok.convert_tokens_to_ids(BOS))
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)
