"""DeepSeek-V2 / V3: multi-head latent attention (MLA) + MoE with shared experts.

KV cache: per token and layer only the compressed latent ``c`` (kv_lora_rank, after kv_a_layernorm)
and the decoupled RoPE key (qk_rope_head_dim), stored as one component ``kv`` of shape
``(1, kv_lora_rank + qk_rope_head_dim)``.

Attention runs in the *absorbed* form. With kv_b_proj split per head into W_UK [nope, r] and
W_UV [v, r], the score of head h is

    q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe

so the query is mapped into latent space, ``[W_UK^T q_nope, q_pe]`` (r + rope dims), and attends
as MQA (one shared KV head) over the cached ``[c, k_pe]`` with values ``c``; the per-head output
``sum_j p_j c_j`` is mapped back with W_UV. Keys and values are never expanded per head.

Routing: V3 uses sigmoid scores + ``e_score_correction_bias`` for selection, group-limited top-k
(best two experts' sum per group, ``topk_group`` groups kept), weights from the raw scores,
optionally renormalised, times ``routed_scaling_factor``. V2 uses softmax scores with greedy or
group-limited greedy (group max) selection. The first ``first_k_dense_replace`` layers are dense.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.attention import paged_attention, store_kv
from ..layers.moe import MoEBlock, StackedExperts
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_inv_freq
from .base import CausalLM
from .llama import DecoderLayer, LlamaMLP


def yarn_softmax_scale(config, head_dim: int) -> float:
    """head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled RoPE (as DeepSeek does)."""
    scale = head_dim ** -0.5
    params = config.rope_parameters or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor") or 1.0
        if mscale_all_dim and factor > 1:
            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, deinterleave: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        # DeepSeek-V3 checkpoints lay rotary dims out as interleaved pairs (x0, x1), (x2, x3)...;
        # transformers de-interleaves them ([evens, odds]) and rotates halves. Doing the same keeps
        # the cached k_pe layout identical to theirs.
        self.deinterleave = deinterleave
        self.layer_idx = layer_idx
        # Softmax scale of the *unabsorbed* head dim (nope + rope), as the checkpoint was trained.
        self.scale = yarn_softmax_scale(config, qk_dim)

    def kv_spec(self) -> KVSpec:
        return KVSpec((("kv", (1, self.kv_lora_rank + self.rope_dim)),))

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.deinterleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return self.rotary(positions, x)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: dict[str, torch.Tensor]) -> torch.Tensor:
        T, H, r = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)

        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self._rope(batch.positions, q_pe)
        k_pe = self._rope(batch.positions, k_pe.unsqueeze(1))
        entry = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)  # [T, 1, r + rope]
        store_kv(kv["kv"], entry, batch.slot_mapping)

        w = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, r)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, r], [H, v, r]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        q_full = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, r + rope]

        cache = kv["kv"]
        o = paged_attention(q_full, entry, entry[..., :r], cache, cache[..., :r], batch, self.scale)
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(o.reshape(T, H * self.v_dim))


class DeepseekMoE(MoEBlock):
    def __init__(self, config, layer_idx: int, version: int) -> None:
        num_experts = config.n_routed_experts
        super().__init__(layer_idx, num_experts, config.num_experts_per_tok)
        self.version = version
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        if version == 3:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(num_experts),
                                                             requires_grad=False)
        self.topk_method = "noaux_tc" if version == 3 else getattr(config, "topk_method", "greedy")
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or self.n_group
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.routed_scaling_factor = config.routed_scaling_factor
        self.experts = StackedExperts(num_experts, config.hidden_size, config.moe_intermediate_size,
                                      ACT2FN[config.hidden_act])
        shared = config.n_shared_experts or 0
        self.shared_experts = (LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared,
                                        getattr(config, "mlp_bias", False)) if shared else None)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, n_group] -> [T, E] boolean: experts of the topk_group best groups."""
        idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
        return keep.repeat_interleave(self.num_experts // self.n_group, dim=1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, K] and their fp32 weights [T, K]."""
        logits = nn.functional.linear(x.float(), self.gate.weight.float())
        E, G = self.num_experts, self.n_group
        if self.version == 3:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.float()
            if G > 1:
                group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
                choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.topk_method == "group_limited_greedy" and G > 1:
                group_scores = scores.view(-1, G, E // G).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            # DeepSeek-V2's reference code renormalises when asked; released V2 configs say False.
            if self.norm_topk_prob and self.top_k > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        out = self.run_experts(x, idx, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def expert_slice(self, proj: str, kind: str) -> tuple[str, slice | None]:
        inter = self.experts.intermediate
        if kind != "weight":
            raise ValueError(f"DeepSeek experts have no {proj}.{kind}")
        if proj == "gate_proj":
            return "gate_up_proj", slice(0, inter)
        if proj == "up_proj":
            return "gate_up_proj", slice(inter, 2 * inter)
        if proj == "down_proj":
            return "down_proj", None
        raise ValueError(f"unknown expert projection {proj!r}")


def deepseek_layer(config, layer_idx: int, rotary: RotaryEmbedding, version: int,
                   deinterleave: bool) -> DecoderLayer:
    """MLA attention; MoE after the first ``first_k_dense_replace`` dense layers."""
    if layer_idx >= (config.first_k_dense_replace or 0) and config.n_routed_experts:
        mlp = DeepseekMoE(config, layer_idx, version)
    else:
        mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                       getattr(config, "mlp_bias", False))
    return DecoderLayer(config, MLAttention(config, layer_idx, rotary, deinterleave), mlp)


class DeepseekModel(nn.Module):
    def __init__(self, config, max_positions: int, version: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, config.qk_rope_head_dim)
        # V2's complex-number rotation keeps pairs interleaved; V3 (rope_interleave) de-interleaves.
        deinterleave = version == 3 and bool(getattr(config, "rope_interleave", True))
        rotary = RotaryEmbedding(inv_freq, max_positions, scaling, interleaved=version == 2)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            deepseek_layer(config, i, rotary, version, deinterleave)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLM):
    unquantized_linears = (r"\.kv_b_proj\.weight$",)  # absorbed MLA reads its weight per head
    version = 3
    fused_shards = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # The router as transformers keeps it: expert choice compares scores + bias in float32, and a
    # bias rounded to bf16 picks other experts.
    fp32_params = (r"\.mlp\.gate\.(weight|e_score_correction_bias)$",)

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, DeepseekModel(config, max_positions, self.version))

    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

    def map_weight_name(self, name: str) -> str | None:
        m = self._LAYER_RE.match(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None  # multi-token-prediction modules (layer 61 of V3): not used for decoding
        return name

    def load_custom_weight(self, target: str, tensor: torch.Tensor) -> str | None:
        return self.load_per_expert_weight(target, tensor)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    version = 2
