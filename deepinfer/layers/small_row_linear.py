"""Float linears for a few rows at a time (``csrc/small_rows.cpp``): batched decode and
speculative verify spans.

For 2-16 rows MKL's float matmul on an AVX2 CPU runs a small threaded sgemm that costs several
times its 1-row matrix-vector path, although both are bound by reading the same weights; so a
verify step of a few tokens cost several decode steps. The native kernel reads each weight row
once for all rows of the call, and gives each output the same bits whatever the number of rows
or threads. ``use_small_row_linears`` swaps every float ``nn.Linear`` of a loaded CPU model
for a ``SmallRowLinear`` (once, at load); calls of more than 16 rows keep ``F.linear``, and so do
calls of one row unless the kernel runs bfloat16 by AVX512-BF16 dot products, which beat oneDNN's
bf16 matrix-vector path too. CUDA, other dtypes, ``DEEPINFER_NO_NATIVE_KERNELS=1`` and a failed
build keep ``nn.Linear``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..native_build import NativeExtension, build_extension
from .linear import WrappedLinear, replace_module

SOURCE = Path(__file__).parent / "csrc" / "small_rows.cpp"
STEM = "deepinfer_small_rows"
# Calls of MIN_ROWS..MAX_ROWS rows run the kernel. One row (batch-1 decode) keeps MKL's
# matrix-vector path, which the AVX2 kernel only matches; above 16 a call is a prefill chunk, where
# MKL's blocked sgemm is faster.
MIN_ROWS, MAX_ROWS = 2, 16
# The kernel's code for bfloat16 with AVX512-BF16 dot products: it runs one-row calls too.
DPBF16_ISA = "avx512_bf16"
DTYPES = (torch.float32, torch.bfloat16)


@cache
def small_rows_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_rows.isa())


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T + bias`` by the native kernel (float32 sums)."""
    return torch.ops.deepinfer_rows.linear(x, weight, bias)


class SmallRowLinear(WrappedLinear):
    """``nn.Linear``'s product, by the native kernel for ``MIN_ROWS``..``MAX_ROWS`` rows; keeps the
    layer's parameters (tied weights stay tied) and ``out_sizes`` so fused layers still split."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        one_row = self.weight.dtype == torch.bfloat16 and small_rows_kernel().isa == DPBF16_ISA
        self.min_rows = 1 if one_row else MIN_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.min_rows * self.in_features <= x.numel() <= MAX_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        y = small_rows_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel=small_rows, "
                f"rows={self.min_rows}..{MAX_ROWS}")


def use_small_row_linears(model: nn.Module) -> int:
    """Swap each float32/bfloat16 CPU ``nn.Linear`` of ``model`` for a ``SmallRowLinear`` where
    the kernel built; returns the number swapped (0 elsewhere)."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype in DTYPES]
    if not targets or not small_rows_kernel().loaded:
        return 0
    for name, linear in targets:
        linear.weight.data = linear.weight.data.contiguous()
        replace_module(model, name, SmallRowLinear(linear))
    return len(targets)
