"""DeepSeek-V4.1 CSA2 attention: long KV computed once, read by the following layers.

The schedule (``deepseek_v41_config.py``) makes each compressed layer FULL, REINDEX or REUSE.
A FULL layer pools disjoint windows of ``r`` tokens (per channel softmax gate, no position bias;
r = 1: the token's own projection) into one RMS-normalised latent per window; the entry is the
latent rotated at the window's first position, its indexer key ``RMSNorm(key_proj(latent))``
rotated alike. Queries as in V4 but without the per-head RMSNorm. REINDEX layers score the FULL
layer's keys with their own indexer queries; REUSE layers attend with the latest index layer's
top-k choice of this step; with a candidate source, the index layers after it choose only among
the entries of the blocks it kept per query (``candidate_blocks``). Every query also sees its sliding window, and entry ``w`` only once
its window has closed (``w < (t + 1) // r``).

Only FULL layers store entries: the others' entry specs share the FULL layer's buffers
(``KVSpec.share_with``), so the pool and the tiers hold each entry once and a prefix hit restores
the shared entries with their owner's pages. A FULL layer with r > 1 keeps its compressor inputs
in the ring (like V4's), r = 1 needs none.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kv.layout import KVSpec
from ..layers.attention import store_kv
from ..layers.compressed_attention import (IndexScoring, V4Batch, WindowCompressor, candidate_blocks,
                                           closing_positions, entry_slots, gather_ring, visible_entries)
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .deepseek_v41_config import FULL, MASKED, REINDEX, REUSE, SOURCE, csa2_layers
from .deepseek_v4_attention import LongKV, V4Attention


class SharedKeyIndexer(IndexScoring, nn.Module):
    """CSA2's Lightning Indexer: queries in every index layer; keys (FULL layers only) projected
    from the compressed latent instead of a compressor of their own."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int,
                 kv_dim: int, eps: float, owns_keys: bool) -> None:
        super().__init__()
        self.init_scoring(hidden, q_lora_rank, heads, head_dim, topk)
        self.key_proj = nn.Linear(kv_dim, head_dim, bias=False) if owns_keys else None
        self.key_norm = RMSNorm(head_dim, eps) if owns_keys else None

    def keys(self, latent: torch.Tensor, starts: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Keys [n, 1, head_dim] of the latents [n, 1, kv_dim] of windows starting at ``starts``."""
        return rotary(starts, self.key_norm(self.key_proj(latent)))


class CSA2Attention(V4Attention):
    def build_long_kv(self, config, layer_idx: int) -> None:
        layer = csa2_layers(config)[layer_idx]
        self.layer_idx, self.mode, self.selection_source = layer_idx, layer.mode, layer.selection_source
        self.q_head_norm = False
        self.candidates = layer.candidates
        self.candidate_blocks = (config.candidate_topk_blocks, config.candidate_block_size)
        self.index_head_dim = config.index_head_dim
        self.indexer: SharedKeyIndexer | None = None
        if layer.kv_source is not None:
            self.entry_source = layer.kv_source
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if self.mode == FULL:
            self.compressor = WindowCompressor(hidden, self.head_dim, self.ratio, overlap=False, eps=eps,
                                               position_bias=False)
        if self.mode in (FULL, REINDEX):
            self.indexer = SharedKeyIndexer(hidden, config.q_lora_rank, config.index_n_heads,
                                            config.index_head_dim, config.index_topk, self.head_dim, eps,
                                            owns_keys=self.mode == FULL)

    def index_scorer(self) -> SharedKeyIndexer | None:
        return self.indexer

    @property
    def pools_from_ring(self) -> bool:
        return self.mode == FULL and self.ratio > 1

    def ring_spec(self) -> KVSpec:
        comps = [("kv", (1, self.head_dim))]
        if self.pools_from_ring:
            comps += [("ckv", (1, self.head_dim)), ("cgate", (1, self.head_dim))]
        return KVSpec(tuple(comps), window=self.ring_window, feeds_pages=self.pools_from_ring)

    def entry_spec(self) -> KVSpec | None:
        """The FULL layer's entries and indexer keys (what every layer of its group reads)."""
        if self.ratio is None:
            return None
        return KVSpec((("entry", (1, self.head_dim)), ("ikey", (1, self.index_head_dim))),
                      tokens_per_entry=self.ratio)

    def store_entries(self, x: torch.Tensor, step: V4Batch, ring_kv: dict[str, torch.Tensor],
                      entry_kv: dict[str, torch.Tensor]) -> None:
        if self.mode != FULL:
            return
        comp, r, ps = self.compressor, self.ratio, step.paged.page_size
        if self.pools_from_ring:
            comp.store_inputs(x, step.ring, ring_kv["ckv"], ring_kv["cgate"])
        for span in step.spans:
            closing = closing_positions(span, r)
            if not closing.numel():
                continue
            if r == 1:  # every new token closes its own window
                latent = comp.kv_norm(comp.kv_proj(x[span.rows])).unsqueeze(1)
            else:
                latent = comp.pool_latent(gather_ring(ring_kv["ckv"], span), gather_ring(ring_kv["cgate"], span),
                                          span.ring_start, span.ring_lo, closing)
            starts = closing + 1 - r
            slots = entry_slots(span.pages, closing, ps, r)
            store_kv(entry_kv["entry"], self.rotary(starts, latent), slots)
            store_kv(entry_kv["ikey"], self.indexer.keys(latent, starts, self.rotary), slots)

    def choose(self, step: V4Batch, span_index: int, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        if self.candidates == SOURCE:
            step.candidates[span_index] = candidate_blocks(scores, visible, *self.candidate_blocks)
        elif self.candidates == MASKED:
            scores = scores.masked_fill(~step.candidates[span_index], float("-inf"))
        return self.indexer.top(scores, visible)

    def long_kv(self, x: torch.Tensor, q_residual: torch.Tensor, step: V4Batch,
                entry_kv: dict[str, torch.Tensor] | None) -> list[LongKV]:
        if self.mode == REUSE:
            ps, entries = step.paged.page_size, entry_kv["entry"].view(-1, 1, self.head_dim)
            return [(entries[visible_entries(span, self.ratio, ps)[0]], chosen)
                    for span, chosen in zip(step.spans, step.selections[self.selection_source])]
        out = super().long_kv(x, q_residual, step, entry_kv)
        if self.ratio is not None:
            step.selections[self.layer_idx] = [chosen for _, chosen in out]
        return out
