"""Our CPU attention of a prefill chunk over its cached keys (``csrc/prefix_attention.cpp``).

The tail of a mostly cached prompt (82 tokens after 8K cached ones) spends nearly all its time
attending over the cached keys: the torch path gathers every page of the sequence in every
layer, and torch's CPU flash kernel runs the query heads of a GQA group separately, each
re-reading the keys, with bfloat16 no faster than float32 (no AMX here). The kernel reads the
pages in place, scores the whole group's query rows against each key tile at once (AVX512-BF16
dot pairs on bfloat16), and returns the log-sum-exp that ``chunk_attention`` merges with the
chunk's own causal part.

``prefix_backend`` is the one place that picks: the kernel for CPU caches in bfloat16 where the
build has AVX512-BF16; the torch path everywhere else (float32, where the flash kernel was as
fast, CUDA, CPUs without AVX512-BF16, ``--attention-backend torch``,
``DEEPINFER_NO_NATIVE_KERNELS=1``).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "csrc" / "prefix_attention.cpp"
STEM = "deepinfer_prefix_attention"


@cache
def native_prefix_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_prefix.isa())


def prefix_backend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str) -> str:
    """``native`` or ``torch``: which code attends a chunk's queries over its cached keys (all
    visible, plain softmax: the caller checks that)."""
    if not (backend == "auto" and q.device.type == "cpu" and k_cache.dtype == q.dtype == v_cache.dtype
            and q.dtype == torch.bfloat16 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.shape[-1] % 2 == 0
            and q.shape[-1] == k_cache.shape[-1]):
        return "torch"
    kernel = native_prefix_kernel()
    return "native" if kernel.loaded and kernel.isa == "avx512bf16" else "torch"


def native_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                  prefix: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] bfloat16 over keys ``0 .. prefix - 1`` of page table ``pages`` -> (out
    [T, Hq, Dv] float32, lse [T, Hq] float32: natural log-sum-exp of the scaled scores)."""
    return torch.ops.deepinfer_prefix.prefix_attention(q.contiguous(), k_cache, v_cache, pages, prefix, scale)
