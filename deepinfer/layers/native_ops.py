"""Our CPU code for the small per-layer ops of a step (``csrc/small_ops.cpp``): rotary
embedding (NeoX halves; with the K/V store, ``attention.rotate_and_store``), RMSNorm, a residual
add fused with the next RMSNorm, and the MLP's ``silu(gate) * up`` (bf16).

At batch-1 decode each of these runs on a few hundred values, so a torch op costs its dispatch
and temporaries more than its arithmetic; one native call replaces the several ops of each.
``small_ops_apply`` is the one check of where they run (float32 or bf16 on the CPU, when it built;
bf16 computed in float32 and rounded once per result, as torch's code computes it);
elsewhere the torch code of ``norm.py`` / ``rotary.py`` runs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "csrc" / "small_ops.cpp"
STEM = "deepinfer_small_ops"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@cache
def small_ops_kernel() -> NativeExtension:
    """Build (once per machine) and load the ops; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_ops.isa())


def small_ops_apply(x: torch.Tensor) -> bool:
    """Whether the native small ops compute on ``x`` (asked several times a layer: ``is_cpu``
    costs a fifth of ``device.type``)."""
    return x.is_cpu and x.dtype in NATIVE_DTYPES and small_ops_kernel().loaded


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's ``torch.argmax`` (the first largest value; a NaN counts as largest) of
    ``x`` [rows, V]: one native pass where the small ops apply, so a bf16 row needs no float32
    copy first."""
    if x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 and small_ops_apply(x):
        return torch.ops.deepinfer_ops.argmax_rows.default(x)
    return x.argmax(dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, gate | up]: one native pass for bf16 on the CPU
    (silu's exponential is ours, so a result may differ from torch's by an ulp, and a gate below
    -87.3 gives -0 where torch's is under 1e-36); float32 keeps torch's ops, whose bits
    transformers' float32 reference shares."""
    if gate_up.dim() == 2 and gate_up.dtype == torch.bfloat16 and gate_up.stride(1) == 1 and small_ops_apply(gate_up):
        return torch.ops.deepinfer_ops.silu_mul.default(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
