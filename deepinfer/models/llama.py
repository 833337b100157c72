"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral): GQA attention + SwiGLU MLP.

The families differ only in switches read from the HF config: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, ``layer_types``).

Cross-layer KV sharing (CLA; no HF equivalent) is switched on by a config attribute:
``cross_layer_kv_share = g`` groups every g adjacent layers, or ``kv_sharing_groups`` lists the
groups explicitly (e.g. ``[[0, 1], [2, 3, 4]]``, each a run of adjacent layers). The first layer of a
group computes and stores K/V; the others project only Q and attend over the owner's cache (they
have no k/v projections: such tensors in a checkpoint are skipped).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.attention import paged_attention, rotate_and_store
from ..layers.linear import FusedLinear
from ..layers.native_ops import silu_mul
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


def kv_share_source(config, i: int) -> int | None:
    """Index of the layer whose KV cache layer i reads (None: layer i owns its cache)."""
    groups = getattr(config, "kv_sharing_groups", None)
    if groups:
        for group in groups:
            group = list(group)
            if group != list(range(group[0], group[0] + len(group))):
                raise ValueError(f"kv_sharing_groups must list adjacent layers, got {group}")
            if i in group[1:]:
                return group[0]
        return None
    size = getattr(config, "cross_layer_kv_share", None) or 1
    return i - i % size if i % size else None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.share_with = kv_share_source(config, layer_idx)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        # A layer reading another layer's cache only projects queries.
        self.qkv_proj = FusedLinear(config.hidden_size,
                                    [q_size] if self.share_with is not None else [q_size, kv_size, kv_size],
                                    bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            if self.share_with is None:
                self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.layer_idx = layer_idx
        self.window = layer_window(config, layer_idx)
        self.scale = self.head_dim ** -0.5

    def kv_spec(self) -> KVSpec:
        return KVSpec.gqa(self.num_kv_heads, self.head_dim, window=self.window,
                          share_with=self.share_with)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.share_with is not None:
            return self._forward_shared(x, batch, kv)
        T = x.shape[0]
        # q | k | v as heads: one view and one split (not a split and a view of each part)
        q, k, v = self.qkv_proj(x).view(T, -1, self.head_dim).split(self.qkv_heads, dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_and_store(self.rotary, batch.positions, q, k, v, kv["k"], kv["v"], batch.slot_mapping)
        o = paged_attention(q, k, v, kv["k"], kv["v"], batch, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, -1))

    def _forward_shared(self, x: torch.Tensor, batch: ForwardBatch,
                        kv: dict[str, torch.Tensor]) -> torch.Tensor:
        """Queries only; K/V are the group owner's, already stored for this step's tokens."""
        T = x.shape[0]
        q = self.qkv_proj(x).view(T, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = self.rotary(batch.positions, q)
        k_cache, v_cache = kv["k"], kv["v"]
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, batch.slot_mapping)
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, batch.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale, window=self.window)
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block shared by the Llama, DeepSeek and gpt-oss families; each family
    supplies its own attention and MLP (dense or MoE)."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), batch, kv))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, LlamaAttention(config, i, rotary),
                         LlamaMLP(config.hidden_size, config.intermediate_size,
                                  getattr(config, "mlp_bias", False)))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_KV_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")


class LlamaForCausalLM(CausalLM):
    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, LlamaModel(config, max_positions))

    def map_weight_name(self, name: str) -> str | None:
        m = _KV_WEIGHT.match(name)
        if m and self.model.layers[int(m.group(1))].self_attn.share_with is not None:
            return None  # K/V projections of a layer that reads a shared cache: unused
        return name
