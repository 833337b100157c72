"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral): GQA attention + SwiGLU MLP.

The families differ only in switches read from the HF config: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, ``layer_types``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.attention import paged_attention, store_kv
from ..layers.linear import FusedLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_inv_freq
from .base import CausalLM


def layer_window(config, i: int) -> int | None:
    """Sliding window of layer i, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[i] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.layer_idx = layer_idx
        self.window = layer_window(config, layer_idx)
        self.scale = self.head_dim ** -0.5

    def kv_spec(self) -> KVSpec:
        return KVSpec.gqa(self.num_kv_heads, self.head_dim, window=self.window)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary(batch.positions, q)
        k = self.rotary(batch.positions, k)
        store_kv(kv["k"], k, batch.slot_mapping)
        store_kv(kv["v"], v, batch.slot_mapping)
        o = paged_attention(q, k, v, kv["k"], kv["v"], batch, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_specs(self) -> list[KVSpec]:
        return [layer.self_attn.kv_spec() for layer in self.model.layers]

    def forward(self, batch: ForwardBatch, kv: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        for layer, layer_kv in zip(self.model.layers, kv):
            x = layer(x, batch, layer_kv)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def tie_weights_if_needed(self, loaded: set[str]) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            loaded.add("lm_head.weight")
