"""Our CPU code for the small per-layer ops of a step (``csrc/small_ops.cpp``): rotary
embedding (NeoX halves), RMSNorm, and a residual add fused with the next RMSNorm.

At batch-1 decode each of these runs on a few hundred values, so a torch op costs its dispatch
and temporaries more than its arithmetic; one native call replaces the several ops of each.
``small_ops_apply`` is the one check of where they run (float32 on the CPU, when it built);
elsewhere the torch code of ``norm.py`` / ``rotary.py`` runs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from ..native_build import NativeExtension, build_extension

SOURCE = Path(__file__).parent / "csrc" / "small_ops.cpp"
STEM = "deepinfer_small_ops"


@cache
def small_ops_kernel() -> NativeExtension:
    """Build (once per machine) and load the ops; never raises."""
    return build_extension(STEM, SOURCE, lambda: torch.ops.deepinfer_ops.isa())


def small_ops_apply(x: torch.Tensor) -> bool:
    """Whether the native small ops compute on ``x``."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and small_ops_kernel().loaded
