"""Sliding-window layers (Mistral, Gemma 2, Gemma 3 text) against transformers, windows < prompt."""

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          MistralConfig, MistralForCausalLM)
from transformers.masking_utils import sliding_window_causal_mask_function

from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from model_check import check_against_hf, make_runner, random_ids, randomize_, run_prompt_logits, hf_logits

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
WINDOW = 8
PROMPT = random_ids(37, 300, 1)  # > 4 windows; pages of 4 tokens
OTHER = random_ids(13, 300, 2)
CHUNKS = [5, 15, 17]  # chunk boundaries off page and window boundaries
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny_mistral():
    cfg = MistralConfig(**BASE, num_hidden_layers=2, sliding_window=WINDOW)
    cfg.architectures = ["MistralForCausalLM"]
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    randomize_(model)
    return model


def tiny_gemma2():
    cfg = Gemma2Config(**BASE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                       sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    cfg.architectures = ["Gemma2ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).eval()
    randomize_(model)
    return model


def tiny_gemma3():
    cfg = Gemma3TextConfig(
        **BASE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        final_logit_softcapping=None)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    randomize_(model)
    model.model.embed_tokens.weight.data /= 8  # x sqrt(hidden) = 8 -> unit-scale activations
    return model


@pytest.mark.parametrize("make", [tiny_mistral, tiny_gemma2, tiny_gemma3],
                         ids=["mistral", "gemma2", "gemma3"])
def test_matches_transformers(make):
    model = make()
    diffs = check_against_hf(model, PROMPT, CHUNKS, OTHER, decode=6)
    assert max(diffs.values()) <= TOL, diffs


def test_window_is_load_bearing():
    """Running with window + 1 must not match: the test above really checks the window bound."""
    import deepinfer.models.llama as llama

    model = tiny_mistral()
    orig = llama.layer_window
    try:
        llama.layer_window = lambda config, i: orig(config, i) + 1
        wrong = run_prompt_logits(make_runner(model), PROMPT, CHUNKS)
    finally:
        llama.layer_window = orig
    assert (wrong - hf_logits(model, PROMPT)).abs().max() > 1e-2


def test_kv_specs_declare_windows():
    runner = make_runner(tiny_gemma3())
    assert [s.window for s in runner.specs] == [WINDOW, WINDOW, None, WINDOW]
    runner = make_runner(tiny_gemma2())  # Gemma 2 default: even layers slide
    assert [s.window for s in runner.specs] == [WINDOW, None, WINDOW, None]


@pytest.mark.parametrize("kv_len,q_len", [(37, 37), (37, 17), (20, 15), (9, 1)])
def test_masks_equal_transformers_definition(kv_len, q_len):
    """ForwardBatch's window masks == transformers' sliding_window_causal_mask_function
    (kv_idx <= q_idx and kv_idx > q_idx - window: the window holds W tokens including itself)."""
    fn = sliding_window_causal_mask_function(WINDOW)
    zero = torch.tensor(0)
    ref = fn(zero, zero, torch.arange(kv_len - q_len, kv_len)[:, None], torch.arange(kv_len)[None, :])
    ps = 4
    pages = torch.arange(-(-kv_len // ps))
    batch = ForwardBatch(input_ids=torch.zeros(q_len, dtype=torch.long),
                         positions=torch.arange(kv_len - q_len, kv_len), slot_mapping=torch.zeros(q_len),
                         page_size=ps, num_decodes=0, decode_pages=None, decode_kv_lens=None,
                         prefills=[PrefillSegment(0, q_len, kv_len, pages)], logits_indices=torch.zeros(1))
    assert torch.equal(batch.prefill_mask(0, WINDOW), ref)
    # The same token as a decode (last query row), over page-padded keys.
    dec = ForwardBatch(input_ids=torch.zeros(1, dtype=torch.long), positions=torch.tensor([kv_len - 1]),
                       slot_mapping=torch.zeros(1), page_size=ps, num_decodes=1,
                       decode_pages=pages[None], decode_kv_lens=torch.tensor([kv_len]), prefills=[],
                       logits_indices=torch.zeros(1))
    mask = dec.decode_mask(WINDOW)[0, 0, 0]
    assert torch.equal(mask[:kv_len], ref[-1]) and not mask[kv_len:].any()
