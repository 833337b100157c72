"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed KV (CSA / HCA).

Queries come through a low-rank ``q_a -> norm -> q_b`` path and a per-head unweighted RMSNorm;
each token caches one vector (``kv_proj``, RMSNorm, RoPE), read as both key and value. RoPE
(interleaved pairs) rotates the *last* ``qk_rope_head_dim`` dims; since values carry that rotation
too, the output's rope dims are rotated back by the query position. Per-head sinks, then a grouped
low-rank output projection: ``o_groups`` head groups each mapped to ``o_lora_rank`` dims
(``o_a_proj``), mixed by ``o_b_proj``. Sliding layers use the ``main`` RoPE, compressed layers
(window and entries) the ``compress`` one. ``layers/compressed_attention.py`` has the compressed
part; V4.1's CSA2 layers (``deepseek_v41.py``) subclass this one.

KV layout: the layer's window ring (K=V vector plus compressor inputs), widened to cover a
compressor's span; a compressed layer also has one paged spec holding its entries (and indexer
keys), one row per ``r`` tokens, in the page of the token closing their window.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kv.layout import KVSpec
from ..layers.attention import store_kv
from ..layers.compressed_attention import (Indexer, IndexScoring, V4Batch, WindowCompressor,
                                           closing_positions, compressed_attention, entry_slots,
                                           gather_ring, visible_entries)
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .deepseek_v41_config import FULL, DeepseekV41Config, csa2_layers

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

LongKV = tuple[torch.Tensor | None, torch.Tensor | None]  # a span's entries, and its top-k choice


def compress_ratio(config, i: int) -> int | None:
    """Tokens per long-KV entry of layer ``i`` (None: window only)."""
    if isinstance(config, DeepseekV41Config):
        return config.compress_ratios[i] or None
    kind = config.layer_types[i]
    return config.compress_rates[kind] if kind in (CSA, HCA) else None


def ring_window(config) -> int:
    """Tokens a ring keeps: the attention window, or more where a compressor spans more."""
    spans = [config.sliding_window]
    if isinstance(config, DeepseekV41Config):  # CSA2 pools disjoint windows, in FULL layers only
        spans += [layer.ratio for layer in csa2_layers(config) if layer.mode == FULL]
        return max(spans)
    for i, kind in enumerate(config.layer_types):
        r = compress_ratio(config, i)
        if r is not None:
            spans.append(2 * r if kind == CSA else r)
    return max(spans)


class V4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        H, hd, hidden, eps = config.num_attention_heads, config.head_dim, config.hidden_size, config.rms_norm_eps
        self.num_heads, self.head_dim, self.groups = H, hd, config.o_groups
        self.window, self.ring_window = config.sliding_window, ring_window(config)
        self.ratio = compress_ratio(config, layer_idx)
        self.entry_source = layer_idx  # the layer whose paged entries this one reads
        self.q_head_norm = True  # V4's unweighted per-head RMSNorm of the queries
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * hd, bias=False)
        self.kv_proj = nn.Linear(hidden, hd, bias=False)
        self.kv_norm = RMSNorm(hd, eps)
        self.o_a_proj = nn.Linear(H * hd // self.groups, self.groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.groups * config.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(H))
        self.rotary = rotary
        self.norm_eps = eps
        self.scale = hd ** -0.5
        self.compressor: WindowCompressor | None = None
        self.build_long_kv(config, layer_idx)

    def build_long_kv(self, config, layer_idx: int) -> None:
        """V4: an HCA compressor, or CSA's overlapping one with its Lightning Indexer."""
        if self.ratio is None:
            return
        hidden, eps = config.hidden_size, config.rms_norm_eps
        csa = config.layer_types[layer_idx] == CSA
        self.compressor = WindowCompressor(hidden, self.head_dim, self.ratio, overlap=csa, eps=eps)
        if csa:
            self.compressor.indexer = Indexer(hidden, config.q_lora_rank, config.index_n_heads,
                                              config.index_head_dim, self.ratio, config.index_topk, eps)

    def index_scorer(self) -> IndexScoring | None:
        return self.compressor.indexer if self.compressor is not None else None

    def ring_spec(self) -> KVSpec:
        comps = [("kv", (1, self.head_dim))]
        if self.compressor is not None:
            width = self.compressor.kv_proj.out_features
            comps += [("ckv", (1, width)), ("cgate", (1, width))]
        idx = self.index_scorer()
        if isinstance(idx, WindowCompressor):
            width = idx.kv_proj.out_features
            comps += [("ikv", (1, width)), ("igate", (1, width))]
        return KVSpec(tuple(comps), window=self.ring_window, feeds_pages=len(comps) > 1)

    def entry_spec(self) -> KVSpec | None:
        if self.ratio is None:
            return None
        comps = [("entry", (1, self.head_dim))]
        if self.index_scorer() is not None:
            comps.append(("ikey", (1, self.index_scorer().head_dim)))
        return KVSpec(tuple(comps), tokens_per_entry=self.ratio)

    def store_entries(self, x: torch.Tensor, step: V4Batch, ring_kv: dict[str, torch.Tensor],
                      entry_kv: dict[str, torch.Tensor]) -> None:
        """Store the projections of the new tokens, then pool every window they close."""
        comp, idx = self.compressor, self.index_scorer()
        parts = [(comp, "ckv", "cgate", "entry")] + ([(idx, "ikv", "igate", "ikey")] if idx else [])
        for mod, kv_name, gate_name, _ in parts:
            mod.store_inputs(x, step.ring, ring_kv[kv_name], ring_kv[gate_name])
        ps = step.paged.page_size
        for span in step.spans:
            closing = closing_positions(span, self.ratio)
            if not closing.numel():
                continue
            slots = entry_slots(span.pages, closing, ps, self.ratio)
            for mod, kv_name, gate_name, out_name in parts:
                kv = gather_ring(ring_kv[kv_name], span)
                gate = gather_ring(ring_kv[gate_name], span)
                entry = mod.pool(kv, gate, span.ring_start, span.ring_lo, closing, self.rotary)
                store_kv(entry_kv[out_name], entry, slots)

    def long_kv(self, x: torch.Tensor, q_residual: torch.Tensor, step: V4Batch,
                entry_kv: dict[str, torch.Tensor] | None) -> list[LongKV]:
        """Per span: the entries its window has closed, and the indexer's top-k among them."""
        if entry_kv is None:
            return [(None, None)] * len(step.spans)
        idx = self.index_scorer()
        if idx is not None:
            q_idx, w_idx = idx.queries(x, q_residual, step.paged.positions, self.rotary)
        out: list[LongKV] = []
        for k, span in enumerate(step.spans):
            slots, visible = visible_entries(span, self.ratio, step.paged.page_size)
            chosen = None
            if idx is not None and slots.numel():
                keys = entry_kv["ikey"].view(-1, idx.head_dim)[slots]
                scores = idx.scores(q_idx[span.rows], w_idx[span.rows], keys, visible)
                chosen = self.choose(step, k, scores, visible)
            out.append((entry_kv["entry"].view(-1, 1, self.head_dim)[slots], chosen))
        return out

    def choose(self, step: V4Batch, span_index: int, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The entries span ``span_index``'s queries read, from the indexer's ``scores``."""
        return self.index_scorer().top(scores, visible)

    def forward(self, x: torch.Tensor, step: V4Batch, ring_kv: dict[str, torch.Tensor],
                entry_kv: dict[str, torch.Tensor] | None) -> torch.Tensor:
        T, H, hd = x.shape[0], self.num_heads, self.head_dim
        positions = step.paged.positions
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(T, H, hd)
        if self.q_head_norm:
            q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.norm_eps).to(q.dtype)
        q = self.rotary(positions, q)
        kv = self.rotary(positions, self.kv_norm(self.kv_proj(x)).unsqueeze(1))
        store_kv(ring_kv["kv"], kv, step.ring.slot_mapping)
        if entry_kv is not None:
            self.store_entries(x, step, ring_kv, entry_kv)
        out = torch.empty_like(q)
        ps = step.paged.page_size
        for span, (entries, chosen) in zip(step.spans, self.long_kv(x, q_residual, step, entry_kv)):
            out[span.rows] = compressed_attention(q[span.rows], span, self.window, self.ratio,
                                                  ring_kv["kv"], entries, chosen, ps, self.scale,
                                                  self.sinks)
        out = self.rotary(positions, out, inverse=True)  # values carried their keys' rotation
        grouped = out.reshape(T, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).reshape(T, -1))
