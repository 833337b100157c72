"""One MoE layer's experts split over ``torch.distributed`` ranks, as an EPLB ``Placement`` says.

Every rank holds the weights of its own slots only (an expert with several copies has them on
several ranks) and sees the same tokens and routing (activations are replicated, as in one engine
per node). A routed pair (token t, expert e) is served by copy ``t mod copies[e]`` of e, i.e. by the
rank ``Placement.replica_of(e, t)``; each rank computes its pairs and one ``all_reduce`` sums the
partial outputs, so the result is the single-device ``sum_k w[t, k] * expert_{idx[t, k]}(x[t])``.
The same code runs on gloo (CPU) and NCCL (CUDA): only the process group differs.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..layers.moe import MoEBlock, StackedExperts
from .eplb import Placement


class ExpertShard(nn.Module):
    """The experts one rank holds: the stacked weights of its slots (one copy per distinct expert)."""

    def __init__(self, experts: StackedExperts, placement: Placement, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.local = sorted(set(placement.devices[rank]))
        keep = torch.tensor(self.local, dtype=torch.long)
        # the same module type (its activation and clamps), holding only this rank's experts
        self.experts = copy.copy(experts)
        self.experts._parameters = {
            "gate_up_proj": nn.Parameter(experts.gate_up_proj.data[keep].clone(), requires_grad=False),
            "down_proj": nn.Parameter(experts.down_proj.data[keep].clone(), requires_grad=False)}
        self.slot_of = {e: i for i, e in enumerate(self.local)}
        # replica_rank[e, c]: the rank holding copy c of expert e
        width = max(placement.copies)
        table = torch.full((len(placement.copies), width), -1, dtype=torch.long)
        seen = [0] * len(placement.copies)
        for d, slots in enumerate(placement.devices):
            for e in slots:
                table[e, seen[e]] = d
                seen[e] += 1
        self.replica_rank = table
        self.copies = torch.tensor(placement.copies, dtype=torch.long)

    def serving_rank(self, idx: torch.Tensor) -> torch.Tensor:
        """[T, K] expert ids -> the rank that serves each (token, slot) pair."""
        tokens = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
        copy = tokens % self.copies.to(idx.device)[idx]
        return self.replica_rank.to(idx.device)[idx, copy]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The layer's routed-expert output for all tokens (identical on every rank)."""
        out = torch.zeros_like(x)
        mine = (self.serving_rank(idx) == self.rank).nonzero()  # [n, 2]: (token, slot)
        tok, slot = mine[:, 0], mine[:, 1]
        experts = idx[tok, slot]
        for e in experts.unique().tolist():
            sel = experts == e
            t = tok[sel]
            y = self.experts(self.slot_of[e], x.index_select(0, t))
            out.index_add_(0, t, (y * weights[t, slot[sel], None]).to(x.dtype))
        dist.all_reduce(out, group=group)
        return out


def shard_experts(model: nn.Module, placements: dict[int, Placement], rank: int,
                  group: dist.ProcessGroup | None = None) -> None:
    """Split every MoE layer of ``model`` (``placements`` by layer index) over the ranks: each
    keeps only its own experts' weights and serves its pairs, the others' come by ``all_reduce``."""
    for block in model.modules():
        if not isinstance(block, MoEBlock):
            continue
        if not isinstance(block.experts, StackedExperts):
            raise ValueError(f"{type(block).__name__}: only stacked experts can be split over ranks")
        shard = ExpertShard(block.experts, placements[block.layer_idx], rank)
        block.experts = shard.experts  # the full stack is dropped from this rank
        block.expert_shard = partial(shard.forward, group=group)
