"""gpt-oss: alternating sliding-window / full attention with per-head attention sinks, and a MoE
MLP (softmax over the top-k router logits, clamped SwiGLU experts with biases).

Weights are the bf16 layout transformers uses in memory (and bf16 exports store):
``experts.gate_up_proj`` [E, H, 2I] with gate/up interleaved along the last dim,
``experts.down_proj`` [E, I, H], plus their biases. The released MXFP4 checkpoints
(``*_blocks``/``*_scales``) are de-quantized into this layout by ``loader/quantized.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.attention import paged_attention, rotate_and_store
from ..layers.linear import FusedLinear
from ..layers.moe import MoEBlock, dispatch_experts
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_inv_freq
from .base import CausalLM
from .llama import DecoderLayer, layer_window


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.rotary = rotary
        self.window = layer_window(config, layer_idx)
        self.scale = self.head_dim ** -0.5

    def kv_spec(self) -> KVSpec:
        return KVSpec.gqa(self.num_kv_heads, self.head_dim, window=self.window)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rotate_and_store(self.rotary, batch.positions, q.view(T, self.num_heads, self.head_dim),
                                k.view(T, self.num_kv_heads, self.head_dim), v, kv["k"], kv["v"], batch.slot_mapping)
        o = paged_attention(q, k, v, kv["k"], kv["v"], batch, self.scale, window=self.window,
                            sinks=self.sinks)
        return self.o_proj(o.reshape(T, -1))


class GptOssExperts(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        E, H, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(E, inter, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return h @ self.down_proj[e] + self.down_proj_bias[e]


class GptOssMoE(MoEBlock):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(layer_idx, config.num_local_experts, config.num_experts_per_tok)
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        out, counts = dispatch_experts(x, idx, weights, self.num_experts, self.experts)
        self.record(counts)
        return out


class GptOssModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, config.head_dim)
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, GptOssAttention(config, i, rotary), GptOssMoE(config, i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(CausalLM):
    unquantized_linears = (r"\.router\.weight$",)
    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, GptOssModel(config, max_positions))
