"""Our own CPU kernel for int8 / int4 weights with fp32 activations (``csrc/qgemm.cpp``), built at
first use.

No kernel that ships with torch keeps activations in float and beats fp32 ``F.linear`` on AVX2
CPUs, and batch-1 decode is bound by the bytes of weight it reads per token. So the kernel reads
the codes (1 or 1/2 byte per value), widens them to fp32 in registers and multiplies them with the
activations as they are.

``torch.utils.cpp_extension.load`` compiles it once per machine into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``), under a name keyed by the source, the compiler flags and the torch
version, so a new source or another CPU class builds afresh. Concurrent first uses wait on each
other through an ``flock`` on the build folder, which the OS drops when its holder dies: torch's
own lock is a plain file that a process killed mid-build leaves behind, and every later ``load``
would wait on it forever, so a leftover one found while holding the flock is removed. AVX2+FMA code where torch itself runs AVX2 or better (detected at run time), portable
scalar code elsewhere. A failed build (no compiler, no ninja) is not an error: ``native_kernel``
says why, and the plan falls back to de-quantizing per matmul. ``DEEPINFER_NO_NATIVE_KERNELS=1``
skips the build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "qgemm.cpp"
DISABLE_ENV = "DEEPINFER_NO_NATIVE_KERNELS"


@dataclass(frozen=True)
class NativeKernel:
    isa: str  # the code it was built with: avx2 | scalar; "" if not loaded
    error: str = ""  # why it is not available, or ""

    @property
    def loaded(self) -> bool:
        return not self.error


def compiler_flags() -> list[str]:
    """Vector ISA flags for this CPU: AVX2+FMA where torch's own kernels run AVX2 or better."""
    isa = ["-mavx2", "-mfma", "-mf16c"] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else []
    return ["-O3", "-fopenmp", *isa]


def build_root() -> Path:
    """Where torch keeps built extensions: ``$TORCH_EXTENSIONS_DIR``, else its cache folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_name(flags: list[str]) -> str:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode()
                         + sys.version.encode())
    return f"deepinfer_qgemm_{key.hexdigest()[:16]}"


@cache
def native_kernel() -> NativeKernel:
    """Build (once per machine) and load the kernel; never raises."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return NativeKernel("", f"disabled by {DISABLE_ENV}")
    flags = compiler_flags()
    try:
        from torch.utils.cpp_extension import load

        name = build_name(flags)
        build_dir = build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "deepinfer.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the OS if this process dies
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
            load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
        return NativeKernel(torch.ops.deepinfer_quant.isa())
    except Exception as e:  # noqa: BLE001  (any build or load failure means: use the fallback)
        reason = str(e).strip().splitlines()
        return NativeKernel("", f"the native kernel did not build ({reason[0] if reason else type(e).__name__})")


def native_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                  bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """``x[M, K] @ W.T + bias`` in fp32, ``W`` in the kernel's layout (``native_codes``)."""
    return torch.ops.deepinfer_quant.linear(x, codes, scale, offset, bias, bits)


def native_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Our packing (int4: low nibble even column) -> the kernel's: per group of 32, byte j holds
    column j in its low nibble and column j + 16 in its high one, so a group unpacks in order."""
    if bits == 8:
        return codes.contiguous()
    n = codes.shape[0]
    values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).view(n, -1, 2, 16)  # [N, G, halves, 16]
    return (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(n, -1).contiguous()
