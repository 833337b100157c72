"""RMSNorm, the normalisation every supported family uses; float32 or bf16 on the CPU runs our
native op (``native_ops.py``: one call instead of five to eight), elsewhere torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .native_ops import small_ops_apply


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        # unit_offset: Gemma stores (weight - 1), i.e. the scale is (1 + weight).
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def _weight(self) -> torch.Tensor:
        w = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        return 1.0 + w if self.unit_offset else w

    def _native_weight(self) -> torch.Tensor:
        """The scale as the native op takes it: the parameter itself (widened there) unless Gemma's offset applies."""
        return self._weight() if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 whatever the activation dtype, as the reference implementations do.
        dtype = x.dtype
        if small_ops_apply(x):
            if x.dim() == 2:  # a block's norm: no reshape and view back (a fifth of the call)
                return torch.ops.deepinfer_ops.rms_norm.default(x.contiguous(), self._native_weight(), self.eps)
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return torch.ops.deepinfer_ops.rms_norm.default(flat, self._native_weight(), self.eps).view(x.shape)
        w = self._weight()
        h = F.rms_norm(x if dtype == torch.float32 else x.float(), w.shape, w, self.eps)
        return h if dtype == torch.float32 else h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))`` for [T, dim] inputs: a block's residual add and
        the next norm, in one native pass where it applies."""
        if small_ops_apply(x) and residual.dtype == x.dtype and x.dim() == 2:
            return torch.ops.deepinfer_ops.add_rms_norm.default(x.contiguous(), residual.contiguous(),
                                                                self._native_weight(), self.eps)
        s = x + residual
        return s, self(s)
