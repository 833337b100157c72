"""Tiny random-weight HF checkpoints (weights, config, tokenizer, chat template) for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Caching saves compute.",
    "user assistant system hello world how are you today? I am fine, thanks.",
    "Prefix caching reuses the key value cache of earlier requests in a conversation.",
    "0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


def make_tokenizer(vocab_size: int = 320, corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def make_checkpoint(path: Path, config, seed: int = 0) -> Path:
    """Save a random model of ``config`` plus the tiny tokenizer to ``path``; returns it."""
    tok = make_tokenizer()
    config.vocab_size = max(config.vocab_size, len(tok))
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the default init, so logits are not near-uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False)
    cfg.update(overrides)
    c = LlamaConfig(**cfg)
    c.architectures = ["LlamaForCausalLM"]
    return c
