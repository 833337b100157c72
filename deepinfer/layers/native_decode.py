"""Our CPU paged decode attention (``csrc/paged_attention.cpp``) and where it runs.

The torch decode path gathers every page of every decoding sequence into a workspace in every
layer, then SDPA reads it again; at long contexts that copy is as many bytes per step as the
weights. The kernel reads K/V in place through the page table instead (GQA heads together,
online softmax in fp32, windows and ring views masked as the torch path masks them).

``decode_backend`` is the one place that picks: the kernel for CPU caches in float32 or
bfloat16 without softcap or sinks when it built, the torch path otherwise (CUDA, other dtypes,
softcap, sinks, ``--attention-backend torch``, ``DEEPINFER_NO_NATIVE_KERNELS=1``).

``span_rows`` runs a short chunk's rows (a speculative verify span) through the same kernel:
each row gets the bits a decode at its position gets, with each K/V block read once for all rows.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..forward_batch import ForwardBatch, PrefillSegment
from ..native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
STEM = "deepinfer_paged_attention"
ATTENTION_BACKENDS = ("auto", "torch")  # auto: the native kernel where it applies
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@cache
def native_decode_kernel() -> NativeExtension:
    """Build (once per machine) and load the kernel; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_attention.isa())


def decode_backend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                   softcap: float | None, sinks: torch.Tensor | None) -> str:
    """``native`` or ``torch``: which code computes this layer's decode attention."""
    native = (batch.attention_backend == "auto" and softcap is None and sinks is None
              and q.is_cpu and q.dtype in NATIVE_DTYPES
              and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
              and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
              and native_decode_kernel().loaded)
    return "native" if native else "torch"


def native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                  scale: float, window: int | None) -> torch.Tensor:
    """q [B, Hq, D] of the batch's decodes -> [B, Hq, Dv], read from the pages in place."""
    return torch.ops.deepinfer_attention.paged_decode.default(
        q.contiguous(), k_cache, v_cache, batch.decode_pages, batch.decode_kv_lens, batch.decode_kv_start,
        batch.decode_kv_lo, window, scale)


def span_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment,
              scale: float, window: int | None) -> torch.Tensor:
    """q [R, Hq, D] of segment ``seg``'s R tokens -> [R, Hq, Dv]; row r (position kv_len - R + r)
    sees, and gets the bits of, what a decode at its position would."""
    return torch.ops.deepinfer_attention.paged_span(q.contiguous(), k_cache, v_cache, seg.pages, seg.kv_len,
                                                    seg.kv_start, seg.kv_lo, window, scale)
