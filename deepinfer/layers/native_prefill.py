"""Our CPU attention of a prefill chunk: its cached keys and, causally, its own (``csrc/prefill_attention.cpp``).

On this kind of CPU (AVX512-BF16, no AMX) torch's CPU flash kernel is no faster in bfloat16 than
in float32, runs the query heads of a GQA group separately (each re-reading the keys), and for a
chunk after cached keys needs them gathered from the pages first. The kernel reads the pages in
place (the chunk's own keys are stored before attention runs), scores the whole group's query
rows against each key tile at once and multiplies the probabilities with the values on bf16
dot-pair instructions, the causal mask applied only on the tiles that cross it: one call for a
cold chunk, a prefix-cache tail, or a later chunk of a chunked prefill.

``prefill_backend`` is the one place that picks: the kernel for CPU caches in bfloat16 where the
build has AVX512-BF16; the torch path everywhere else (float32, where the flash kernel was as
fast, CUDA, CPUs without AVX512-BF16, ``--attention-backend torch``,
``DEEPINFER_NO_NATIVE_KERNELS=1``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.cpp"
STEM = "deepinfer_prefill_attention"


@cache
def native_prefill_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_prefill.isa())


def prefill_backend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str) -> str:
    """``native`` or ``torch``: which code attends a chunk's queries over its keys (every earlier
    key visible, plain softmax: the caller checks that)."""
    if not (backend == "auto" and q.device.type == "cpu" and k_cache.dtype == q.dtype == v_cache.dtype
            and q.dtype == torch.bfloat16 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and q.shape[-1] % 2 == 0 and q.shape[-1] == k_cache.shape[-1] and v_cache.shape[-1] % 16 == 0):
        return "torch"
    kernel = native_prefill_kernel()
    return "native" if kernel.loaded and kernel.isa == "avx512bf16" else "torch"


def native_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                   start: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D] bfloat16 at positions ``start .. start + T - 1`` over keys ``0 .. start + T - 1``
    of page table ``pages`` (its own already stored), causally -> [T, Hq, Dv] bfloat16."""
    return torch.ops.deepinfer_prefill.prefill_attention(q.contiguous(), k_cache, v_cache, pages, start, scale)
