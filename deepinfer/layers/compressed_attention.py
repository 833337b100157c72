"""DeepSeek-V4 attention over a sliding window plus compressed KV entries (CSA / HCA).

Every V4 layer attends to the last ``W`` tokens (one shared K=V vector per token) and, in CSA and
HCA layers, to *compressed entries*: entry ``w`` pools the window of ``r`` tokens ending at
position ``(w + 1) * r - 1`` with a learned softmax gate per channel (HCA: r = 128, disjoint
windows). CSA (r = 4) overlaps windows: entry ``w`` pools two series, the ``Ca`` half of window
``w - 1`` and the ``Cb`` half of window ``w``, and a Lightning Indexer picks the ``index_topk``
entries each query reads. Entry ``w`` is visible to a query at ``t`` only once its window has
closed: ``w < (t + 1) // r``.

Where the state lives (see the model's ``kv_specs``):

* the window ring (``kv/window.py``) holds per token the K=V vector and the compressor's input
  projections (``ckv``/``cgate``, and ``ikv``/``igate`` of the indexer): an entry is pooled from
  the ring when its window closes, so a chunk boundary or a prefix hit needs no other compressor
  state than the ring's last tokens;
* the page pool holds the entries (``entry``, and the indexer key ``ikey``) in the page of the
  token that closed their window, ``ceil(page_size / r)`` rows a page, so a cached page carries
  exactly the entries its tokens decide. A replay from a page boundary cannot rebuild the ring's
  compressor inputs, so V4 hits restore a ring snapshot or recompute from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from .attention import attend, gather_pages, store_kv
from .norm import RMSNorm
from .rotary import RotaryEmbedding


@dataclass
class SeqSpan:
    """One sequence of a step, as both KV groups see it."""

    rows: slice  # its new tokens in the flattened batch
    start: int  # position of its first new token
    end: int  # context length after this step
    ring_pages: torch.Tensor  # window-group pages in position order; the first holds ring_start
    ring_start: int
    ring_lo: int  # ring positions below this hold nothing of this sequence
    pages: torch.Tensor  # page table of the paged group, covering [0, end)


@dataclass
class V4Batch:
    """A step as V4 layers read it: the paged batch, the ring view and the sequences."""

    paged: ForwardBatch
    ring: ForwardBatch
    spans: list[SeqSpan]
    # V4.1 (CSA2): each index-source layer's top-k choice per span, for the layers reusing it,
    # and the candidate entries per span (by span index) of the candidate-source layer
    selections: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def build(paged: ForwardBatch, ring: ForwardBatch) -> V4Batch:
        spans: list[SeqSpan] = []
        if paged.num_decodes:
            ends = paged.decode_kv_lens.tolist()
            starts = ring.decode_kv_start.tolist() if ring.decode_kv_start is not None else [0] * len(ends)
            los = ring.decode_kv_lo.tolist() if ring.decode_kv_lo is not None else [0] * len(ends)
            for b, end in enumerate(ends):
                spans.append(SeqSpan(slice(b, b + 1), end - 1, end, ring.decode_pages[b], starts[b],
                                     los[b], paged.decode_pages[b]))
        for seg, rseg in zip(paged.prefills, ring.prefills):
            spans.append(SeqSpan(slice(seg.q_start, seg.q_start + seg.q_len), seg.kv_len - seg.q_len,
                                 seg.kv_len, rseg.pages, rseg.kv_start, rseg.kv_lo, seg.pages))
        return V4Batch(paged, ring, spans)


def entry_slots(pages: torch.Tensor, closing: torch.Tensor, page_size: int, ratio: int) -> torch.Tensor:
    """Rows of the entries whose windows close at ``closing``: in the page of the closing token,
    which holds ``ceil(page_size / ratio)`` rows (``KVSpec.tokens_per_entry``)."""
    rows = -(-page_size // ratio)
    return pages[closing // page_size] * rows + (closing % page_size) // ratio


def visible_entries(span: SeqSpan, ratio: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the entries closed by ``span.end`` and which of them each new token sees [nq, n]."""
    dev = span.pages.device
    n = span.end // ratio
    slots = entry_slots(span.pages, (torch.arange(n, device=dev) + 1) * ratio - 1, page_size, ratio)
    qpos = torch.arange(span.start, span.end, device=dev)[:, None]
    return slots, torch.arange(n, device=dev)[None, :] < (qpos + 1) // ratio


def gather_ring(buf: torch.Tensor, span: SeqSpan) -> torch.Tensor:
    """The ring entries of positions [span.ring_start, span.end), in order."""
    return gather_pages(buf, span.ring_pages)[: span.end - span.ring_start]


def closing_positions(span: SeqSpan, ratio: int) -> torch.Tensor:
    """Positions of this step's new tokens that close a compression window."""
    first = -(-(span.start + 1) // ratio) * ratio - 1
    return torch.tensor(range(first, span.end, ratio), dtype=torch.long, device=span.pages.device)


class WindowCompressor(nn.Module):
    """Pools windows of ``ratio`` tokens into one ``head_dim`` entry (``overlap``: CSA's two series;
    ``position_bias``: V4's learned per-slot gate bias, which V4.1's CSA2 compressor lacks)."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float,
                 position_bias: bool = True) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        # ratio 1 (V4.1's uncompressed long KV): nothing to pool, so no gate
        self.gate_proj = nn.Linear(hidden, width, bias=False) if ratio > 1 else None
        self.position_bias = nn.Parameter(torch.empty(ratio, width)) if position_bias else None
        self.kv_norm = RMSNorm(head_dim, eps)
        self.indexer: Indexer | None = None  # CSA layers: set by the attention

    def store_inputs(self, x: torch.Tensor, ring: ForwardBatch, kv: torch.Tensor, gate: torch.Tensor) -> None:
        store_kv(kv, self.kv_proj(x).unsqueeze(1), ring.slot_mapping)
        store_kv(gate, self.gate_proj(x).unsqueeze(1), ring.slot_mapping)

    def pool_latent(self, kv: torch.Tensor, gate: torch.Tensor, first_pos: int, lo: int,
                    closing: torch.Tensor) -> torch.Tensor:
        """Unrotated entries [n, 1, head_dim] of the windows closing at ``closing``, from the
        projections ``kv``/``gate`` [L, 1, width] of positions ``first_pos`` onwards (valid from ``lo``)."""
        r, d = self.ratio, self.head_dim
        span = 2 * r if self.overlap else r
        pos = closing[:, None] - torch.arange(span - 1, -1, -1, device=closing.device)  # [n, span]
        idx = (pos - first_pos).clamp(min=0)
        k, g = kv[idx, 0].float(), gate[idx, 0].float()  # [n, span, width]
        if self.overlap:  # slots [0, r): Ca of window w - 1; [r, 2r): Cb of window w
            bias = self.position_bias.float()
            k = torch.cat((k[:, :r, :d], k[:, r:, d:]), dim=1)
            g = torch.cat((g[:, :r, :d] + bias[:, :d], g[:, r:, d:] + bias[:, d:]), dim=1)
        elif self.position_bias is not None:
            g = g + self.position_bias.float()
        g = g.masked_fill((pos < max(lo, 0))[..., None], float("-inf"))  # window 0 has no Ca
        pooled = (k * g.softmax(dim=1)).sum(dim=1).to(kv.dtype)
        return self.kv_norm(pooled).unsqueeze(1)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first_pos: int, lo: int,
             closing: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """The entries of ``pool_latent``, rotated at their window's first position."""
        return rotary(closing + 1 - self.ratio, self.pool_latent(kv, gate, first_pos, lo, closing))


class IndexScoring:
    """The query side of a Lightning Indexer (a mixin over modules holding ``q_b_proj``,
    ``scorer.weights_proj``, ``heads``, ``head_dim`` and ``topk``): per query
    ``sum_h w_h relu(q_h . k)`` scores over entry keys, and the top-k visible entries."""

    q_b_proj: nn.Linear
    scorer: nn.Module
    heads: int
    head_dim: int
    topk: int

    def init_scoring(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int) -> None:
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hidden, heads, bias=False)

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_b_proj(q_residual).view(x.shape[0], self.heads, self.head_dim)
        weights = self.scorer.weights_proj(x).float() * self.heads ** -0.5
        return rotary(positions, q).float(), weights

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """q [nq, h, d], weights [nq, h], keys [n, d], visible [nq, n] -> scores [nq, n], -inf unseen."""
        scores = torch.relu(torch.einsum("qhd,nd->qhn", q, keys.float())) * self.head_dim ** -0.5
        return (scores * weights[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))

    def top(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The ``topk`` best visible entries per query: chosen [nq, n] bool."""
        top = scores.topk(min(self.topk, scores.shape[1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible & (scores > float("-inf"))


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                     block_size: int) -> torch.Tensor:
    """V4.1's hierarchical selection: per query [nq, n] the entries of its ``topk_blocks`` blocks of
    ``block_size`` entries with the best maximum score, the latest visible block always kept."""
    nq, n = scores.shape
    padded = torch.nn.functional.pad(scores, (0, -n % block_size), value=float("-inf"))
    best = padded.view(nq, -1, block_size).amax(dim=-1)  # [nq, blocks]
    last = (visible.sum(dim=1, keepdim=True) - 1).div(block_size, rounding_mode="floor")
    best = best.masked_fill(torch.arange(best.shape[1], device=scores.device) == last, float("inf"))
    top = best.topk(min(topk_blocks, best.shape[1]), dim=-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=1)[:, :n] & visible


class Indexer(IndexScoring, WindowCompressor):
    """V4's Lightning Indexer: keys from its own CSA-style (overlapping) compressor."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, ratio: int,
                 topk: int, eps: float) -> None:
        super().__init__(hidden, head_dim, ratio, overlap=True, eps=eps)
        self.init_scoring(hidden, q_lora_rank, heads, head_dim, topk)


def compressed_attention(q: torch.Tensor, span: SeqSpan, window: int, ratio: int | None,
                         ring_kv: torch.Tensor, entries: torch.Tensor | None,
                         chosen: torch.Tensor | None, page_size: int, scale: float,
                         sinks: torch.Tensor) -> torch.Tensor:
    """One sequence's queries q [nq, H, D] over its window keys plus its visible entries."""
    dev = q.device
    qpos = torch.arange(span.start, span.end, device=dev)[:, None]
    keys = gather_pages(ring_kv, span.ring_pages)[: span.end - span.ring_start]
    kpos = torch.arange(span.ring_start, span.end, device=dev)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= max(span.ring_lo, 0))
    if entries is not None and entries.shape[0]:
        visible = torch.arange(entries.shape[0], device=dev)[None, :] < (qpos + 1) // ratio
        if chosen is not None:
            visible = visible & chosen
        keys = torch.cat((keys, entries), dim=0)
        mask = torch.cat((mask, visible), dim=1)
    kt = keys.transpose(0, 1)[None]  # [1, 1, L, D]: one head, read as K and V
    return attend(q.transpose(0, 1)[None], kt, kt, mask[None, None], scale, sinks=sinks)[0].transpose(0, 1)
