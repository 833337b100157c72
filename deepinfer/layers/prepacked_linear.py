"""Float linears of more rows than the small-row kernel takes, through oneDNN on a weight
reordered once at load.

Prefill chunks and batched decodes of more than 16 sequences multiply tens to thousands of rows
by each weight. ``F.linear`` hands float32 to MKL's sgemm and bfloat16 to oneDNN on the plain
``[out, in]`` weight, which both re-block the weight on every call; oneDNN's linear on a weight
already in its blocked layout (``mkldnn._reorder_linear_weight``, what inductor's CPU freezing
uses) skips that, and streams the blocked weight from memory faster too. Calls of ``MIN_ROWS``
rows or more take that path; fewer rows (batch-1 and small-batch decode, verify spans) keep the
wrapped layer (``SmallRowLinear`` or ``nn.Linear``) and its kernels, whose results do not depend
on the number of rows. The packed copy costs a second copy of each wrapped weight, the LM head's
included: a prefill computes one row of logits per sequence, but a batched decode one per
sequence of the batch. CUDA, a torch without oneDNN, bfloat16 on a CPU oneDNN has no bf16 path
for, and ``DEEPINFER_NO_PREPACK=1`` keep the layers as they are. bfloat16 layers on a CPU with AVX512-BF16
and no AMX are ``BatchRowsLinear`` by then (``batch_rows_linear.py``), not wrapped here.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .linear import SplitOutputs, replace_module
from .small_row_linear import DTYPES, MAX_ROWS, SmallRowLinear

DISABLE_ENV = "DEEPINFER_NO_PREPACK"
# bfloat16 calls of fewer rows are the small-row kernel's (SmallRowLinear); above them oneDNN on
# the packed weight beats F.linear at every row count (docs/figures/execution.md). float32 keeps
# F.linear (MKL, what transformers runs: fp32 stays comparable to it) below prefill chunks.
MIN_ROWS = MAX_ROWS + 1
FP32_MIN_ROWS = 64
# Rows the weight's blocked layout is chosen for (any row count runs on it).
PACK_ROWS = 2048


def prepack_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` on this CPU (and is not switched off)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0") or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x[..., K] @ weight.T + bias`` on a weight from ``torch.ops.mkldnn._reorder_linear_weight``
    (the op's overload named: a packet call picks among the overloads at every call; looked up
    here, not at import, as a torch without oneDNN has no such op)."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


class PrepackedLinear(SplitOutputs, nn.Module):
    """``inner``'s product; calls of ``MIN_ROWS`` rows or more on the packed weight. The
    parameters stay ``inner``'s (tied weights stay tied, loaders and hooks see them)."""

    def __init__(self, inner: nn.Linear | SmallRowLinear) -> None:
        super().__init__()
        self.inner = inner
        self.in_features = inner.in_features
        self.out_features = inner.out_features
        self.out_sizes = inner.out_sizes if isinstance(inner, SplitOutputs) else [inner.out_features]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(inner.weight.detach().contiguous(), PACK_ROWS)
        # a plain tensor beside the packed weight (a snapshot of the loaded model's, as that is):
        # ``self.inner.bias`` costs two module attribute lookups a call
        self.packed_bias = None if inner.bias is None else inner.bias.detach()
        self.min_rows = MIN_ROWS if inner.weight.dtype == torch.bfloat16 else FP32_MIN_ROWS

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return self.inner.forward(x)  # not inner(x): no second module call per decode linear
        return packed_linear(x, self.packed, self.packed_bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, large_rows=onednn_packed"


def use_prepacked_linears(model: nn.Module) -> int:
    """Wrap each float CPU linear of ``model`` (``nn.Linear`` or ``SmallRowLinear``; a float32 LM
    head stays, as its logits stay comparable to transformers') in a ``PrepackedLinear`` where
    oneDNN runs its dtype; returns the number wrapped (0 elsewhere)."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, SmallRowLinear)) and m.weight.device.type == "cpu"
               and (m.weight.dtype == torch.bfloat16 or name.rpartition(".")[2] != "lm_head") and m.weight.dtype in DTYPES]
    targets = [(name, m) for name, m in targets if prepack_available(m.weight.dtype)]
    for name, linear in targets:
        replace_module(model, name, PrepackedLinear(linear))
    return len(targets)
