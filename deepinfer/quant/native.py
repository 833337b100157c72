"""Our own CPU kernel for int8 / int4 weights and fp32 or bf16 activations in and out
(``csrc/qgemm.cpp``), built at first use.

No kernel that ships with torch keeps activations accurate and beats fp32 ``F.linear`` on AVX2
CPUs, and batch-1 decode is bound by the bytes of weight it reads per token. So the kernel reads
the codes (1 or 1/2 byte per value, repacked at load 8 output rows together: ``quant/packed.py``)
and dots them in integers with the activations rounded once per call to int16 (or int8) codes
per block of 32, or widens them to fp32 and keeps the activations as they are (``act_bits``).

Built at first use by ``deepinfer/native_build.py`` (shared by all our C++ sources: cache key,
build lock, AVX2 or scalar code). A failed build is not an error: ``native_kernel`` says why, and
the plan falls back to de-quantizing per matmul. ``DEEPINFER_NO_NATIVE_KERNELS=1`` skips the build.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..native_build import DISABLE_ENV, NativeExtension, build_extension
from .packed import PackedWeight

__all__ = ["DISABLE_ENV", "LINEAR_OP", "SOURCE", "linear_args", "native_kernel", "native_linear"]

SOURCE = Path(__file__).parent / "csrc" / "qgemm.cpp"
STEM = "deepinfer_qgemm"


@cache
def native_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_quant.isa())


def native_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, act_bits: int,
                  vnni: bool = True, wide: bool = True) -> torch.Tensor:
    """``x[M, K] @ W.T + bias``, ``W`` packed by ``pack_weight``, ``x`` fp32 or bf16 and the result in
    its dtype (bf16: computed as for ``x.float()``, then rounded once; ``bias`` is fp32 either way).
    ``act_bits`` 16 or 8: each block of 32 values of a row of ``x`` is rounded first to int16 /
    int8 codes (``round(x * L / max|x|)``, ``L`` = 32767 or 127, one scale per block), then dotted
    exactly with the weight codes; 32: the codes are widened to fp32 and ``x`` is kept as it is.
    ``vnni=False`` runs the AVX2 integer loop even in an AVX-512 VNNI build (the same bits: tests
    and benchmarks compare the two in one process); builds without VNNI ignore it. ``wide=False``
    keeps calls of several rows off the 512-bit tiles (``csrc/qgemm_wide.h``; the same bits) where
    the build has them."""
    # the resolved overload: the packet picks among overloads at every call (looked up here, not
    # at import, as the op exists only once the kernel is loaded)
    return torch.ops.deepinfer_quant.linear.default(x, *linear_args(w, bias, act_bits, vnni, wide))


LINEAR_OP = "deepinfer_quant::linear"


def linear_args(w: PackedWeight, bias: torch.Tensor | None, act_bits: int, vnni: bool = True,
                wide: bool = True) -> tuple[torch.Tensor | int | bool | None, ...]:
    """The arguments of ``LINEAR_OP`` after ``x`` (``native_linear``'s)."""
    return w.codes, w.scale, w.offset, bias, w.out_features, w.bits, act_bits, vnni, wide
