"""Mixture-of-experts building blocks: token dispatch over routed experts and routing statistics.

Experts are stored as stacked 3D weights (one tensor per projection, expert-major), which is how
transformers keeps them in memory; checkpoints on disk usually name each expert separately and are
copied into their slice at load time (see ``MoEBlock.load_expert_weight``).

Dispatch sorts the (token, slot) pairs by expert once, then loops over the experts that received
tokens: each one gathers its tokens with ``index_select``, runs its MLP as dense matmuls and
scatters the weighted result back with ``index_add_``. No per-token Python loop; one host sync per
layer (the per-expert counts, which are also what the statistics record).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn


def dispatch_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int,
                     expert_fn: Callable[[int, torch.Tensor], torch.Tensor]
                     ) -> tuple[torch.Tensor, list[int]]:
    """sum_k w[t, k] * expert_{idx[t, k]}(x[t]) for every token t; also returns tokens per expert.

    x [T, H]; topk_idx/topk_w [T, K]; ``expert_fn(e, xs)`` maps [n, H] -> [n, H].
    """
    T, K = topk_idx.shape
    out = torch.zeros_like(x)
    flat = topk_idx.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync
    if T == 0:
        return out, counts
    order = torch.argsort(flat, stable=True)
    tokens = order // K
    weights = topk_w.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sl = slice(start, start + n)
        start += n
        tok = tokens[sl]
        y = expert_fn(e, x.index_select(0, tok))
        out.index_add_(0, tok, (y * weights[sl, None]).to(x.dtype))
    return out, counts


class MoEBlock(nn.Module):
    """Base of a model's MoE layer: keeps per-expert token counts (latest step and cumulative).

    Subclasses call ``self.record(counts)`` once per forward. ``CausalLM.moe_stats()`` collects
    every MoEBlock of a model.
    """

    def __init__(self, layer_idx: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.top_k = top_k
        # experts split over ranks (parallel/expert_parallel.py): (x, idx, weights) -> routed output
        self.expert_shard: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.reset_stats()

    def run_experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted output (on this rank's shard when split), recorded."""
        if self.expert_shard is None:
            out, counts = dispatch_experts(x, idx, weights, self.num_experts, self.experts)
        else:
            counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts).tolist()
            out = self.expert_shard(x, idx, weights)
        self.record(counts)
        return out

    def reset_stats(self) -> None:
        self.last_counts: list[int] = [0] * self.num_experts
        self.total_counts: list[int] = [0] * self.num_experts
        self.steps = 0

    def record(self, counts: list[int]) -> None:
        self.last_counts = counts
        self.total_counts = [a + b for a, b in zip(self.total_counts, counts)]
        self.steps += 1

    # Per-expert checkpoint names ("experts.3.gate_proj.weight") -> slices of the stacked tensors.
    _EXPERT_RE = re.compile(r"experts\.(\d+)\.(\w+)\.(weight|bias)$")

    def load_expert_weight(self, rel_name: str, tensor: torch.Tensor) -> str | None:
        """Copy one per-expert tensor into its slice; returns the stacked parameter's name."""
        m = self._EXPERT_RE.search(rel_name)
        if m is None:
            return None
        e, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        target, rows = self.expert_slice(proj, kind)
        param = getattr(self.experts, target)
        dst = param.data[e] if rows is None else param.data[e][rows]
        if dst.shape != tensor.shape:
            raise ValueError(f"{rel_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
        return target

    def expert_slice(self, proj: str, kind: str) -> tuple[str, slice | None]:
        raise NotImplementedError


class StackedExperts(nn.Module):
    """``num_experts`` gated MLPs: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = act

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return nn.functional.linear(self.act(gate) * up, self.down_proj[e])
