"""bfloat16 linears on a CPU with AVX512-BF16 and no AMX, at every row count, on a weight packed
once at load (``csrc/batch_rows.cpp``).

There the other kernels each leave a lot on the table: for a few rows (decode) the small-row
kernel streamed the weights at about half the memory bandwidth, and for tens of rows (batched
decode) oneDNN's packed GEMM lost about a third of its cache-resident rate streaming a model's
layers one after another (docs/figures/execution.md). This kernel multiplies 8 rows by 48
columns per register tile on dot-pair instructions, each thread walking its own run of the
packed weight and asking for the next block while it multiplies this one. Every output is one
function of its row of x and its weight row, so a row gets the same bits in a batch of any size
(decode, a verify span, a prefill chunk) and on any number of threads.

On a CPU with AMX tiles oneDNN multiplies on those, which this kernel does not use, so the
layers stay as they are there; likewise for float32, CUDA, an odd input size, and where the
kernel did not build (``DEEPINFER_NO_NATIVE_KERNELS=1``, no compiler, no AVX512-BF16).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import torch
from torch import nn

from ..hardware import cpu_isa
from ..native_build import NativeExtension, build_extension
from .linear import NativeLinear, WrappedLinear, replace_module

SOURCE = Path(__file__).parent / "csrc" / "batch_rows.cpp"
STEM = "deepinfer_batch_rows"
KERNEL_ISA = "avx512_bf16"
LINEAR_OP = "deepinfer_batch::linear"


@cache
def batch_rows_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_batch.isa())


def batch_rows_usable() -> bool:
    """Whether bfloat16 linears take this kernel here: it built with its dot pairs and the CPU has
    no AMX tiles (oneDNN's, faster where they exist)."""
    return "amx_bf16" not in cpu_isa().flags and batch_rows_kernel().isa == KERNEL_ISA


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` in the kernel's layout: panels of 16 output columns, key pairs inner."""
    return torch.ops.deepinfer_batch.pack(weight.detach())


def batch_rows_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    """``x[M, K] @ weight.T + bias`` on ``pack_weight(weight)``, in bfloat16 (fp32 sums)."""
    return torch.ops.deepinfer_batch.linear.default(x, packed, bias, out_features)  # the resolved overload


class BatchRowsLinear(WrappedLinear):
    """``linear``'s product by the kernel at every row count; the packed copy is a snapshot of
    the loaded weight, as oneDNN's packed one is."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.packed = pack_weight(linear.weight)
        # fp32 (exact for a bf16 bias): the kernel adds it to the fp32 sums, no cast per call
        self.packed_bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the step's rows as they come (no reshape and view back: a decode's glue)
            return batch_rows_linear(x, self.packed, self.packed_bias, self.out_features)
        y = batch_rows_linear(x.reshape(-1, self.in_features), self.packed, self.packed_bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def native(self) -> NativeLinear:
        return NativeLinear(LINEAR_OP, (self.packed, self.packed_bias, self.out_features), max_rows=sys.maxsize)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=batch_rows"


def use_batch_rows_linears(model: nn.Module) -> int:
    """Swap each bfloat16 CPU ``nn.Linear`` of ``model`` (even input size) for a
    ``BatchRowsLinear`` where the kernel is usable; returns the number swapped (0 elsewhere)."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16
               and m.in_features % 2 == 0]
    if not targets or not batch_rows_usable():
        return 0
    for name, linear in targets:
        replace_module(model, name, BatchRowsLinear(linear))
    return len(targets)
