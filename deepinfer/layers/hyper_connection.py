"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is ``n`` parallel streams.

Each block reads one mix of the streams (``pre`` weights), and its output is spread back over them
(``post``) while the streams themselves are mixed by a doubly-stochastic matrix (``comb``, projected
with Sinkhorn-Knopp iterations), so the residual transform stays non-expansive however deep the
stack. All three come from one small projection of the normalised, flattened streams; fp32 throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """Weights of one block's streams: ``fn`` [(2 + n) * n, n * D], ``base``, ``scale`` [3]."""

    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n = n
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor, block) -> torch.Tensor:
        """streams [T, n, D] -> streams after ``block`` ([T, D] -> [T, D]) and the mixing."""
        n = self.n
        flat = _unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        dtype = streams.dtype
        out = block((pre.unsqueeze(-1) * streams).sum(dim=1).to(dtype))
        # stream k of the result: post_k * out + sum_j comb[j, k] * stream_j
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden vector, before the last norm."""

    def __init__(self, hidden: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()
        pre = torch.sigmoid(mix) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
