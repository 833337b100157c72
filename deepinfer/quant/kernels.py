"""Which matmul kernel runs a quantized linear layer on this machine, checked at start-up.

Candidates (``benchmarks/quant_kernels.py`` times them against fp32 ``F.linear``):

- ``native``: our own CPU kernel (``quant/native.py``, ``csrc/qgemm.cpp``), built at first use,
  for the matmuls of decode (up to ``quant/linear.py``'s ``NATIVE_MAX_ROWS`` rows; prefill-sized
  calls de-quantize once and run ``F.linear``). It rounds each block of 32 activations to int16
  with its own scale and takes exact integer dots with the int8 / int4 codes: faster than
  widening the codes to fp32, and as accurate at SmolLM2's argmax (docs/figures/execution.md). Auto on CPU whenever
  it builds, except where ``tinygemm`` is auto. The weights are repacked for it at load, 8 output
  rows per register (``quant/packed.py``). Its variants, opt-in:
- ``native-int8``: activations rounded to int8 per block of 32 (GGUF's Q8 activations), then the
  same integer loop; below the 99% argmax bar on SmolLM2 (docs/figures/execution.md), so never auto.
- ``native-float``: activations kept in fp32 (codes widened to fp32 in registers): its only
  error is the weights' own, so it is the exactness reference.
- ``fbgemm``: ``torch.ops.quantized.linear_dynamic`` on int8 weights prepacked for the x86
  quantized engine. Faster than fp32 ``F.linear`` at every M measured, but it also quantizes
  its activations (uint8, one scale per call, 7-bit range against AVX2's 16-bit overflow), and the
  outlier channels of LLM activations make that lossy (docs/figures/execution.md: SmolLM2's teacher-forced
  argmax agreement with fp32 collapses). So it is opt-in (``--quantization-kernel fbgemm``), never auto.
- ``tinygemm``: ``aten._weight_int4pack_mm_for_cpu``, group-wise int4 weights with bf16
  activations; auto on CPUs with AMX bf16 when the model runs in bf16 (not on AVX512-BF16 alone,
  where ``native`` beat it: docs/figures/execution.md). Where bf16 is
  emulated (AVX2) it was slower than fp32; with fp32 activations (and likewise
  ``aten._weight_int8pack_mm``) many times slower, so never used that way.
- ``dequant``: de-quantize the weight into the activation dtype at each call, then ``F.linear``.
  Runs on every device (CUDA included) and keeps activations exact; the weights take 1 (int8) or
  about 0.6 (int4) bytes per value in memory, but each call is slower than an unquantized layer.

``plan_quantization`` picks per scheme and device; when the wanted kernel is missing it falls back
and says so in ``QuantPlan.note``, which the engine prints at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hardware import cpu_isa
from .native import native_kernel

QUANTIZATIONS = ("none", "int8", "int4")
KERNELS = ("auto", "native", "native-int8", "native-float", "fbgemm", "tinygemm", "dequant")
# the native kernel's variants -> the bits its activations are rounded to (32: kept in fp32)
NATIVE_ACT_BITS = {"native": 16, "native-int8": 8, "native-float": 32}


@dataclass(frozen=True)
class QuantPlan:
    scheme: str  # what the weights are stored as: none | int8 | int4
    kernel: str  # what runs them: none | native | native-int8 | native-float | fbgemm | tinygemm | dequant
    note: str = ""  # why the plan differs from the request, or ""

    def describe(self) -> str:
        text = "unquantized" if self.scheme == "none" else f"{self.scheme} weights, {self.kernel} kernel"
        return f"{text} ({self.note})" if self.note else text


def fbgemm_engine() -> str | None:
    """The quantized engine whose prepacked int8 linear runs here, or None."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("quantized::linear_dynamic", "CPU"):
        return None
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm") if e in engines), None)


def has_tinygemm_cpu() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int4pack_mm_for_cpu", "CPU")


def plan_quantization(scheme: str, kernel: str, device: torch.device, dtype: torch.dtype) -> QuantPlan:
    """The kernel for ``scheme``; ``kernel="auto"``: the fastest one that keeps activations in
    float or in int16 blocks (``fbgemm`` and ``native-int8`` are opt-in, see the module docstring).
    Missing kernels fall back to ``dequant``; only ``auto`` and the ``native*`` ones build the native kernel."""
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {scheme!r}")
    if kernel not in KERNELS:
        raise ValueError(f"quantization kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if scheme == "none":
        return QuantPlan("none", "none")
    if kernel == "fbgemm" and scheme != "int8" or kernel == "tinygemm" and scheme != "int4":
        raise ValueError(f"the {kernel} kernel does not run {scheme} weights")
    cpu = device.type == "cpu"
    if kernel == "fbgemm":
        if cpu and fbgemm_engine() is not None:
            return QuantPlan("int8", "fbgemm", "activations quantized per call too: lossy")
        return QuantPlan("int8", "dequant", f"no fbgemm int8 kernel on this {device.type}; "
                                            "de-quantizing per matmul instead")
    tinygemm_ok = cpu and has_tinygemm_cpu() and dtype == torch.bfloat16
    # auto only with AMX: on AVX512-BF16 alone (Zen 4) the native kernel was faster per call, and
    # under tinygemm the int8 layers (a GGUF's Q8_0 LM head) de-quantize per matmul
    amx = "amx_bf16" in cpu_isa().bf16_flags
    if scheme == "int4" and tinygemm_ok and (kernel == "tinygemm" or kernel == "auto" and amx):
        return QuantPlan("int4", "tinygemm")
    if kernel == "tinygemm":
        return QuantPlan("int4", "dequant", "tinygemm needs a CPU and --dtype bfloat16; "
                                            "de-quantizing per matmul instead")
    if kernel == "dequant":
        return QuantPlan(scheme, "dequant")
    if not cpu:  # e.g. CUDA: de-quantizing per matmul is the kernel there
        asked = kernel in NATIVE_ACT_BITS
        return QuantPlan(scheme, "dequant", f"the native kernel is CPU code; de-quantizing per matmul on "
                                            f"{device.type}" if asked else "")
    native = native_kernel()
    if native.loaded:
        return QuantPlan(scheme, kernel if kernel in NATIVE_ACT_BITS else "native")
    return QuantPlan(scheme, "dequant", f"{native.error}; de-quantizing per matmul instead: "
                                        "smaller weights, not faster")
