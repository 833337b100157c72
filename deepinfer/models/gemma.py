"""Gemma 2 and Gemma 3 (text): hybrid sliding-window / global attention decoders.

Differences from Llama, all read from the HF config:

* embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype first (as HF does);
* RMSNorm scale is ``(1 + weight)``; four norms per layer: before/after attention, before/after MLP;
* GeGLU MLP (``gelu_pytorch_tanh``); softmax scale ``query_pre_attn_scalar ** -0.5``;
* Gemma 2: tanh soft-capping of attention logits (``attn_logit_softcapping``);
* Gemma 3: per-head q/k RMSNorm, and RoPE per layer type (local base for sliding layers,
  global base + scaling for full layers);
* final logit soft-capping (``final_logit_softcapping``) when set;
* ``layer_types`` says which layers are sliding (window ``sliding_window``) and which are global.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.attention import paged_attention, rotate_and_store
from ..layers.linear import FusedLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_inv_freq
from .base import CausalLM
from .llama import layer_window


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:  # Gemma 2 default: even layers slide, odd layers are global
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(config.num_hidden_layers)]
    return list(types)


def _rotary_for(config, layer_type: str, head_dim: int, max_positions: int) -> RotaryEmbedding:
    params = config.rope_parameters or {}
    nested = layer_type in params  # Gemma 3: one RoPE parameter set per layer type
    inv_freq, scaling = rope_inv_freq(config, head_dim, layer_type if nested else None)
    return RotaryEmbedding(inv_freq, max_positions, scaling)


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.gemma3 = config.model_type == "gemma3_text"
        if self.gemma3:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
            self.softcap = None  # transformers' Gemma 3 never soft-caps attention logits
        else:
            self.softcap = getattr(config, "attn_logit_softcapping", None)
        self.rotary = rotary
        self.window = layer_window(config, layer_idx)
        self.scale = config.query_pre_attn_scalar ** -0.5

    def kv_spec(self) -> KVSpec:
        return KVSpec.gqa(self.num_kv_heads, self.head_dim, window=self.window)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.gemma3:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_and_store(self.rotary, batch.positions, q, k, v, kv["k"], kv["v"], batch.slot_mapping)
        o = paged_attention(q, k, v, kv["k"], kv["v"], batch, self.scale, window=self.window,
                            softcap=self.softcap)
        return self.o_proj(o.reshape(T, -1))


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate])
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx, rotary)
        self.mlp = GemmaMLP(h, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), batch, kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        types = _layer_types(config)
        rotaries = {t: _rotary_for(config, t, head_dim, max_positions) for t in sorted(set(types))}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size ** 0.5  # a plain float: computed, never loaded
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, rotaries[types[i]]) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text-only, ``model_type == "gemma3_text"``)."""

    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int) -> None:
        if config.model_type not in ("gemma2", "gemma3_text"):
            raise ValueError(f"GemmaForCausalLM supports gemma2 and gemma3_text, not {config.model_type!r}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma (embedding models) is not supported for generation")
        super().__init__(config, GemmaModel(config, max_positions))
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def tied_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", True))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # HF multiplies by the scale cast to the weights' dtype (sqrt(3072) -> 55.5 in bf16).
        return x * torch.tensor(self.model.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
