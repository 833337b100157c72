"""``QuantizedLinear`` and ``quantize_model``: every linear layer of a loaded model, LM head
included, swapped for one that keeps its weight quantized and runs it with the planned kernel.

Quantizing after loading keeps one code path for every checkpoint format; GGUF checkpoints hand
over their Q4/Q8 blocks as they are (``quant/gguf_blocks.py``) so they are never rounded twice.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import FusedLinear, NativeLinear, SplitOutputs, replace_module
from .kernels import NATIVE_ACT_BITS, QuantPlan, fbgemm_engine
from .native import LINEAR_OP, linear_args, native_linear
from .packed import pack_weight
from .weights import QuantizedWeight, GROUP, quantize_int4, quantize_int8

# Rows up to which the native kernel runs a call (decode, spec verify, batched decode); above it
# (prefill chunks) de-quantizing once and a float matmul is as fast or faster
# (benchmarks/quant_kernels.py compares them at M = 1 .. 512).
NATIVE_MAX_ROWS = 128
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes the native kernel takes as they are


class QuantizedLinear(SplitOutputs, nn.Module):
    """``y = x @ W.T + b`` with ``W`` int8 or int4; keeps ``out_sizes`` so fused layers still split."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernel: str,
                 out_sizes: list[int]) -> None:
        super().__init__()
        self.kernel = kernel
        self.out_sizes = out_sizes
        self.out_features = sum(out_sizes)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if kernel == "fbgemm":
            if weight.bits != 8 or weight.group != weight.shape[1] or weight.offset is not None:
                raise ValueError("the fbgemm kernel runs symmetric per-channel int8 weights only")
            scale = weight.scale[:, 0].double()
            with warnings.catch_warnings():  # torch marks its quantized tensors as deprecated
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    weight.codes, scale, torch.zeros_like(scale, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(
                    qw, None if bias is None else bias.float())
        elif kernel == "tinygemm":
            if weight.bits != 4 or weight.offset is None:
                raise ValueError("the tinygemm kernel runs asymmetric int4 weights only")
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values().int(), 1)
            # tinygemm de-quantizes (q - 8) * scale + zero, ours q * scale + offset
            zero = weight.offset + 8 * weight.scale
            self._scales_zeros = torch.stack((weight.scale, zero), -1).transpose(0, 1).contiguous()
            self._group = weight.group
        elif kernel in NATIVE_ACT_BITS:  # the kernel's layout only: the row-major codes are dropped
            self.weight = pack_weight(weight)
        elif kernel == "dequant":
            self.weight = weight
        else:
            raise ValueError(f"unknown quantization kernel {kernel!r}")
        self.scheme = f"int{weight.bits}"
        self.act_bits = NATIVE_ACT_BITS.get(kernel, 0)  # 0: not the native kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        if self.act_bits and x.numel() <= NATIVE_MAX_ROWS * k:  # first: the decode step's path
            if x.dim() == 2 and x.dtype in NATIVE_DTYPES:  # the step's rows as they come: no reshape, view, cast
                return self._native(x.contiguous())
            x2 = x.reshape(-1, k)
            y = self._native(x2.contiguous() if x2.dtype in NATIVE_DTYPES else x2.float().contiguous())
            return y.to(x.dtype).view(*lead, self.out_features)
        if self.kernel == "fbgemm":  # bias is inside the packed weight
            y = torch.ops.quantized.linear_dynamic(x.reshape(-1, k).float(), self._packed, True)
            return y.to(x.dtype).view(*lead, self.out_features)
        if self.kernel == "tinygemm":
            x2 = x.reshape(-1, k).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self._packed, self._group, self._scales_zeros.to(torch.bfloat16))
            y = y.to(x.dtype).view(*lead, self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.dequantize(x.dtype), bias)

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        """The native kernel on rows ``x2`` [M, K]: fp32 and bf16 go in and come out as they are."""
        bias = None if self.bias is None else self.bias.float()
        return native_linear(x2, self.weight, bias, self.act_bits)

    def native(self) -> NativeLinear | None:
        """The native kernel as ``forward`` runs it on up to ``NATIVE_MAX_ROWS`` rows (None for
        the other kernels)."""
        if not self.act_bits:
            return None
        bias = None if self.bias is None else self.bias.detach().float()
        return NativeLinear(LINEAR_OP, linear_args(self.weight, bias, self.act_bits), max_rows=NATIVE_MAX_ROWS)

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, scheme={self.scheme}, kernel={self.kernel}"


def quantize_weight(w: torch.Tensor, plan: QuantPlan) -> QuantizedWeight:
    if plan.scheme == "int4":
        return quantize_int4(w)
    return quantize_int8(w, group=None if plan.kernel == "fbgemm" else GROUP)


def quantize_model(model: nn.Module, plan: QuantPlan, skip: tuple[str, ...] = (),
                   prequantized: dict[str, QuantizedWeight] | None = None) -> int:
    """Replace each ``nn.Linear`` (those whose ``<name>.weight`` matches a ``skip`` regex, and layers narrower than a
    whole number of quantization groups, excepted) by a
    ``QuantizedLinear``; ``prequantized`` maps a module name to a weight the checkpoint already
    holds quantized (its own blocks, kept at their precision). Returns the number of layers replaced."""
    if plan.scheme == "none":
        return 0
    if plan.kernel == "fbgemm":
        torch.backends.quantized.engine = fbgemm_engine()
    prequantized = prequantized or {}
    grouped = plan.kernel != "fbgemm"  # fbgemm's int8 is per channel: any width
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(re.search(p, f"{name}.weight") for p in skip)
               and not (grouped and m.in_features % GROUP)]  # (tiny test models) stay float
    for name, linear in targets:
        weight = prequantized.get(name)
        if weight is None or weight.shape != tuple(linear.weight.shape):
            weight = quantize_weight(linear.weight.data, plan)
        weight = weight.to(linear.weight.device)  # checkpoint blocks are read on the host
        bias = None if linear.bias is None else linear.bias.data
        out_sizes = linear.out_sizes if isinstance(linear, FusedLinear) else [linear.out_features]
        kernel = "dequant" if plan.kernel == "tinygemm" and weight.bits != 4 else plan.kernel
        replace_module(model, name, QuantizedLinear(weight, bias, kernel, out_sizes))
    return len(targets)
