"""Llama, Qwen2 and Qwen3 (and the embedded SmolLM2) against transformers' reference code."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from deepinfer.llm import LLM
from deepinfer.loader import load_checkpoint
from deepinfer.sampling_params import SamplingParams
from model_check import check_against_hf, random_ids, randomize_

TOL = 1e-4
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)


def build(cfg_cls, model_cls, **extra):
    torch.manual_seed(0)
    cfg = cfg_cls(**{**BASE, **extra})
    cfg.architectures = [model_cls.__name__]
    model = model_cls(cfg).eval()
    randomize_(model)
    return model


@pytest.mark.parametrize("make", [
    lambda: build(LlamaConfig, LlamaForCausalLM),
    lambda: build(LlamaConfig, LlamaForCausalLM, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    lambda: build(Qwen2Config, Qwen2ForCausalLM),
    lambda: build(Qwen3Config, Qwen3ForCausalLM, head_dim=32),
], ids=["llama", "llama3-rope-tied", "qwen2", "qwen3"])
def test_matches_transformers(make):
    diffs = check_against_hf(make(), random_ids(37, 300, 1), [5, 15, 17], random_ids(13, 300, 2))
    assert max(diffs.values()) <= TOL, diffs


@pytest.fixture(scope="module")
def smollm2():
    ckpt = load_checkpoint(None, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    return ckpt, hf


def test_embedded_smollm2_logits_and_greedy_match_transformers(smollm2):
    ckpt, hf = smollm2
    llm = LLM(None, num_pages=256, progress=False)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = ckpt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    runner = llm.engine.runner
    from model_check import run_prompt_logits
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = run_prompt_logits(runner, ids, [len(ids) - 7, 7])
    assert (ours - ref).abs().max().item() <= TOL
    out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0))[0]
    expect = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    assert out.token_ids == expect.tolist()[: len(out.token_ids)]
    assert "Paris" in out.text
