"""RMSNorm, the normalisation every supported family uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        # unit_offset: Gemma stores (weight - 1), i.e. the scale is (1 + weight).
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 whatever the activation dtype, as the reference implementations do.
        dtype = x.dtype
        w = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        if self.unit_offset:
            w = 1.0 + w
        h = F.rms_norm(x if dtype == torch.float32 else x.float(), w.shape, w, self.eps)
        return h if dtype == torch.float32 else h.to(dtype)
