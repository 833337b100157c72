"""A dense, unpaged, single-sequence DeepSeek-V4.1 CSA2 attention, written from the published math
(NeMo Automodel's ``deepseek_v41`` description), to check the engine's paged CSA2 layers against.

It replaces ``self_attn`` in transformers' DeepSeek-V4 model (mHC, MoE and RoPE tables are V4's),
with parameter names equal to ours so the engine loads the same state dict. Every forward
recomputes the whole sequence: FULL layers pool every complete window of ``r`` tokens, later
layers of their group read those entries from ``shared`` (written earlier in the same forward).
"""

from __future__ import annotations

import torch
from torch import nn


def schedule(config) -> list[tuple[int, int | None, int | None]]:
    """Per layer: (ratio, kv source layer, selection source layer), straight from the fields."""
    out, kv, sel = [], None, None
    for i, r in enumerate(config.compress_ratios[: config.num_hidden_layers]):
        if r:
            kv = i if i in config.kv_source_layer_ids else kv
            sel = i if i in config.index_source_layer_ids else sel
        out.append((r, kv if r else None, sel if r else None))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of the last 2 * cos.shape[-1] dims; cos/sin [T, d/2], x [T, ..., D]."""
    d = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head, tail = x[..., :-d], x[..., -d:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((head, rotated), dim=-1)


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms(x, self.weight, self.eps)


class CSA2Reference(nn.Module):
    def __init__(self, config, layer_idx: int, shared: dict) -> None:
        super().__init__()
        H, hd, D, eps = config.num_attention_heads, config.head_dim, config.hidden_size, config.rms_norm_eps
        self.H, self.hd, self.eps, self.window, self.groups = H, hd, eps, config.sliding_window, config.o_groups
        self.layer_idx, self.shared = layer_idx, shared
        self.ratio, self.kv_source, self.sel_source = schedule(config)[layer_idx]
        self.topk, self.ih, self.ihd = config.index_topk, config.index_n_heads, config.index_head_dim
        self.candidate_source = config.candidate_source_layer_id
        self.n_blocks, self.block = config.candidate_topk_blocks, config.candidate_block_size
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_norm = Norm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * hd, bias=False)
        self.kv_proj = nn.Linear(D, hd, bias=False)
        self.kv_norm = Norm(hd, eps)
        self.o_a_proj = nn.Linear(H * hd // self.groups, self.groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.groups * config.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        if self.ratio and self.kv_source == layer_idx:
            self.compressor = nn.Module()
            self.compressor.kv_proj = nn.Linear(D, hd, bias=False)
            if self.ratio > 1:
                self.compressor.gate_proj = nn.Linear(D, hd, bias=False)
            self.compressor.kv_norm = Norm(hd, eps)
        if self.ratio and self.sel_source == layer_idx:
            self.indexer = nn.Module()
            self.indexer.q_b_proj = nn.Linear(config.q_lora_rank, self.ih * self.ihd, bias=False)
            self.indexer.scorer = nn.Module()
            self.indexer.scorer.weights_proj = nn.Linear(D, self.ih, bias=False)
            if self.kv_source == layer_idx:
                self.indexer.key_proj = nn.Linear(hd, self.ihd, bias=False)
                self.indexer.key_norm = Norm(self.ihd, eps)

    def compress(self, x, cos, sin):
        """FULL layer: entries and indexer keys of every complete window."""
        r, comp = self.ratio, self.compressor
        n = x.shape[0] // r
        windows = x[: n * r].view(n, r, -1)
        values = comp.kv_proj(windows)
        if r > 1:
            values = (values * comp.gate_proj(windows).softmax(dim=1)).sum(dim=1)
        else:
            values = values[:, 0]
        latent = comp.kv_norm(values)
        starts = torch.arange(n) * r
        keys = self.indexer.key_norm(self.indexer.key_proj(latent))
        return rope(latent, cos[starts], sin[starts]), rope(keys, cos[starts], sin[starts])

    def candidate_blocks(self, scores, allowed):
        """Entries of each query's best ``n_blocks`` blocks (by max score), its latest block kept."""
        T, n = scores.shape
        keep = torch.zeros(T, n, dtype=torch.bool)
        for t in range(T):
            seen = int(allowed[t].sum())
            if not seen:
                continue
            blocks = [(scores[t, b:b + self.block].max().item(), b) for b in range(0, n, self.block)]
            latest = (seen - 1) // self.block * self.block
            ranked = sorted(blocks, key=lambda sb: (sb[1] != latest, -sb[0]))[: self.n_blocks]
            for best, b in ranked:
                if best > float("-inf") or b == latest:
                    keep[t, b:b + self.block] = True
        return keep & allowed

    def forward(self, hidden_states, position_embeddings, **kwargs):
        x = hidden_states[0]
        T = x.shape[0]
        cos, sin = (t[0] for t in position_embeddings["compress" if self.ratio else "main"])
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = rope(self.q_b_proj(q_latent).view(T, self.H, self.hd), cos, sin)
        kv = rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        t = torch.arange(T)[:, None]
        keys, mask = kv, (torch.arange(T)[None, :] <= t) & (torch.arange(T)[None, :] > t - self.window)
        if self.ratio:
            if self.kv_source == self.layer_idx:
                self.shared[self.layer_idx] = self.compress(x, cos, sin)
            entries, ikeys = self.shared[self.kv_source]
            n = entries.shape[0]
            allowed = torch.arange(n)[None, :] < (t + 1) // self.ratio
            if self.sel_source == self.layer_idx:
                iq = rope(self.indexer.q_b_proj(q_latent).view(T, self.ih, self.ihd), cos, sin)
                w = self.indexer.scorer.weights_proj(x) * (self.ih * self.ihd) ** -0.5
                scores = (torch.relu(torch.einsum("thd,nd->thn", iq, ikeys)) * w[..., None]).sum(1)
                scores = scores.masked_fill(~allowed, float("-inf"))
                if self.layer_idx == self.candidate_source:
                    self.shared["candidates"] = self.candidate_blocks(scores, allowed)
                elif 0 <= self.candidate_source < self.layer_idx:
                    scores = scores.masked_fill(~self.shared["candidates"], float("-inf"))
                chosen = torch.zeros_like(allowed)
                if n:
                    chosen.scatter_(1, scores.topk(min(self.topk, n), dim=-1).indices, True)
                self.shared["selection"] = chosen & (scores > float("-inf"))
            keys = torch.cat((keys, entries))
            mask = torch.cat((mask, self.shared["selection"]), dim=1)
        logits = torch.einsum("thd,nd->htn", q, keys) * self.hd ** -0.5
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = self.sinks.view(-1, 1, 1).expand(-1, T, 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("htn,nd->thd", probs, keys)
        out = rope(out, cos, -sin)  # undo the values' rotation at the query position
        grouped = out.reshape(T, self.groups, -1)
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).reshape(T, -1))[None], None


def with_csa2_reference(hf_model) -> nn.Module:
    """Swap every layer's attention of a transformers DeepSeek-V4 model for the CSA2 reference."""
    shared: dict = {}
    for i, layer in enumerate(hf_model.model.layers):
        layer.self_attn = CSA2Reference(hf_model.config, i, shared)
    return hf_model
