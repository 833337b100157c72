"""DeepSeek-V4: shared-KV MQA over a sliding window plus compressed KV (CSA / HCA), mHC residual
streams, and MoE with ``sqrtsoftplus`` routing (hash-routed in the first layers).

Attention lives in ``deepseek_v4_attention.py`` (V4's CSA / HCA) and ``deepseek_v41.py`` (V4.1's
CSA2 cross-layer sharing, chosen by a ``DeepseekV41Config``). KV layout: spec ``i``
(i < num_layers) is layer i's window ring; after those, one paged spec per compressed layer holds
its entries (a layer reading another layer's entries has a spec sharing that layer's buffers).

MoE: scores ``sqrt(softplus(logits))``; experts chosen by top-k of scores + a selection bias, or, in
``hash_moe`` layers, by a fixed token-id table (``tid2eid``); weights are the chosen scores,
normalised, times ``routed_scaling_factor``. Experts and the shared expert are SwiGLU with the gate
clamped above and the up projection clamped both ways at ``swiglu_limit``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..forward_batch import ForwardBatch
from ..kv.layout import KVSpec
from ..layers.compressed_attention import V4Batch
from ..layers.hyper_connection import HyperConnection, HyperHead
from ..layers.moe import MoEBlock, StackedExperts
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_inv_freq
from .base import CausalLM
from .deepseek_v41 import CSA2Attention
from .deepseek_v41_config import DeepseekV41Config
from .deepseek_v4_attention import V4Attention, compress_ratio

# DeepSeek's own checkpoint names (what the released folders, and transformers' save_pretrained,
# hold) -> transformers' module names, which ours follow. Applied in order, after dropping "model.".
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"^embed\.", "embed_tokens."), (r"^head\.", "lm_head."), (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.attn_sink$", ".sinks"),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_EXPERT_PROJ = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


class ClampedSwiGLU(nn.Module):
    """The shared expert: SwiGLU with clamped gate / up pre-activations."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedExperts(StackedExperts):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__(num_experts, hidden, intermediate, nn.functional.silu)
        self.limit = limit

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return nn.functional.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[e])


class V4MoE(MoEBlock):
    def __init__(self, config, layer_idx: int) -> None:
        E, hidden = config.n_routed_experts, config.hidden_size
        super().__init__(layer_idx, E, config.num_experts_per_tok)
        self.hashed = config.mlp_layer_types[layer_idx] == "hash_moe"
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, hidden))
        if self.hashed:
            self.gate.tid2eid = nn.Parameter(torch.empty(config.vocab_size, self.top_k, dtype=torch.long),
                                             requires_grad=False)
        else:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(E), requires_grad=False)
        self.score = ACT2FN[config.scoring_func]
        self.routed_scaling_factor = config.routed_scaling_factor
        limit = config.swiglu_limit
        self.experts = ClampedExperts(E, hidden, config.moe_intermediate_size, limit)
        self.shared_experts = ClampedSwiGLU(hidden, config.moe_intermediate_size * config.n_shared_experts, limit)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(nn.functional.linear(x.float(), self.gate.weight.float()))
        if self.hashed:
            idx = self.gate.tid2eid[input_ids]
        else:
            choice = scores + self.gate.e_score_correction_bias.float()
            idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor

    def expert_slice(self, proj: str, kind: str) -> tuple[str, slice | None]:
        if kind != "weight" or proj not in _EXPERT_PROJ:
            raise ValueError(f"DeepSeek-V4 experts have no {proj}.{kind}")
        target, half = _EXPERT_PROJ[proj]
        inter = self.experts.intermediate
        return target, None if half is None else slice(half * inter, (half + 1) * inter)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x, input_ids)
        return self.run_experts(x, idx, weights) + self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        attention = CSA2Attention if isinstance(config, DeepseekV41Config) else V4Attention
        self.self_attn = attention(config, layer_idx, rotary)
        self.mlp = V4MoE(config, layer_idx)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        hc = (hidden, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, step: V4Batch, ring_kv: dict[str, torch.Tensor],
                entry_kv: dict[str, torch.Tensor] | None) -> torch.Tensor:
        streams = self.attn_hc(streams, lambda h: self.self_attn(self.input_layernorm(h), step,
                                                                  ring_kv, entry_kv))
        ids = step.paged.input_ids
        return self.ffn_hc(streams, lambda h: self.mlp(self.post_attention_layernorm(h), ids))


class V4Model(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        rotaries = {}
        for kind in ("main", "compress"):
            inv_freq, scaling = rope_inv_freq(config, config.head_dim, kind)
            rotaries[kind] = RotaryEmbedding(inv_freq, max_positions, scaling, interleaved=True, tail=True)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, i, rotaries["main" if compress_ratio(config, i) is None else "compress"])
            for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(CausalLM):
    unquantized_linears = (r"\.o_a_proj\.weight$",)  # the grouped output projection reads its weight per group
    fp32_params = (r"(attn_hc|ffn_hc|hc_head)\.", r"\.sinks$", r"position_bias$", r"norm\.weight$",
                   r"\.mlp\.gate\.(weight|e_score_correction_bias)$")

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, V4Model(config, max_positions))
        self.hc_mult = config.hc_mult
        # spec index of each compressed layer's entries (after the per-layer ring specs)
        compressed = [i for i, layer in enumerate(self.model.layers) if layer.self_attn.ratio is not None]
        n = len(self.model.layers)
        self.entry_spec_index = {layer: n + k for k, layer in enumerate(compressed)}

    def kv_specs(self) -> list[KVSpec]:
        attns = [layer.self_attn for layer in self.model.layers]
        entries = []
        for i, a in enumerate(attns):
            if a.ratio is None:
                continue
            spec = a.entry_spec()
            if a.entry_source != i:  # CSA2: reads a source layer's entries, stores none of its own
                spec = replace(spec, share_with=self.entry_spec_index[a.entry_source])
            entries.append(spec)
        return [a.ring_spec() for a in attns] + entries

    def forward(self, batch: ForwardBatch, kv: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Residual streams [T, hc_mult, hidden] of the new tokens; writes their KV into ``kv``."""
        step = V4Batch.build(batch, batch.for_layer(0))
        x = self.embed(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            entry = self.entry_spec_index.get(i)
            streams = layer(streams, step, kv[i], None if entry is None else kv[entry])
        return streams

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(self.model.hc_head(hidden)))

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None  # multi-token-prediction modules: not used for decoding
        name = name.removeprefix("model.")
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        return name if name.startswith("lm_head.") else "model." + name

    def load_custom_weight(self, target: str, tensor: torch.Tensor) -> str | None:
        return self.load_per_expert_weight(target, tensor)
