"""Small checkpoints built on the fly: a random Llama as an HF folder, and the same model as a GGUF."""

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, TokenizersBackend
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# HF -> GGUF names of a decoder layer's projections (llama.cpp's, for every architecture here)
PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def random_llama(vocab_size: int = 300, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    return randomise_norms(LlamaForCausalLM(config).eval())


def randomise_norms(model):
    """Norms start at 1.0: randomise them so that a wrong mapping cannot pass by luck."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def word_tokenizer(vocab_size: int) -> TokenizersBackend:
    specials = ["<unk>", "<s>", "</s>", "<|eot|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = TokenizersBackend(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHATML
    return tokenizer


def save_hf_folder(model: LlamaForCausalLM, folder: Path, max_shard_size: str | None = None) -> Path:
    """config.json, safetensors (sharded if asked), tokenizer, and a generation config with two eos ids."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3]).save_pretrained(folder)
    return folder


def byte_level_tokens() -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style vocabulary: 3 control tokens, the 256 byte symbols, two merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["he", "ll"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, ["h e", "l l"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model: LlamaForCausalLM, path: Path, architecture: str = "llama") -> Path:
    """The model as an F32 GGUF the way llama.cpp writes it, so conversion back must be exact."""
    c = model.config
    tokens, types, merges = byte_level_tokens()
    assert len(tokens) == c.vocab_size
    w = gguf_writer(path, architecture, "tiny-llama", c)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)  # <|endoftext|>: <|im_end|> must still become an eos id, via the template
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", **PROJECTIONS}
    for i in range(c.num_hidden_layers):
        for hf, gg in leaves.items():
            tensor = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                tensor = llama_cpp_permute(tensor, c.num_attention_heads)
            elif gg == "attn_k":
                tensor = llama_cpp_permute(tensor, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(tensor))
    return write_gguf(w, path)


def gguf_writer(path: Path, architecture: str, name: str, c) -> GGUFWriter:
    """A writer holding the shape keys every architecture here shares (``c``: the HF config)."""
    w = GGUFWriter(str(path), architecture)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    return w


def write_gguf(w: GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def sentencepiece_tokens() -> tuple[list[str], list[int]]:
    """A Gemma-like sentencepiece vocabulary: control tokens, then pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581h", "\u2581he", "ll", "llo"]
    return specials + pieces, [3, 3, 3, 2, 3, 3] + [1] * len(pieces)


def random_gemma3(vocab_size: int, seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=32, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    return randomise_norms(Gemma3ForCausalLM(config).eval())


def write_gemma3_gguf(model, path: Path) -> Path:
    """The model as an F32 GGUF the way llama.cpp writes Gemma 3: norms stored as `w + 1`, no q/k permute."""
    c = model.config
    tokens, types = sentencepiece_tokens()
    w = gguf_writer(path, "gemma3", "tiny-gemma3", c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(GEMMA_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"] + 1)
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", **PROJECTIONS}
    for i in range(c.num_hidden_layers):
        for hf, gg in leaves.items():
            tensor = sd[f"model.layers.{i}.{hf}.weight"]
            w.add_tensor(f"blk.{i}.{gg}.weight", tensor + 1 if "norm" in gg else tensor)
    return write_gguf(w, path)
