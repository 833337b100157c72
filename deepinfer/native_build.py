"""Build and load our C++ operator sources (``torch.ops.deepinfer_*``) at first use.

``torch.utils.cpp_extension.load`` compiles a source once per machine into torch's extension
cache (``$TORCH_EXTENSIONS_DIR``), under a name keyed by the source (its text and its path), the
compiler flags, the torch version and the Python version, so a new source or another CPU class
builds afresh. The path is in the key because the build folder's ninja file names the source
by path: two checkouts sharing one folder would each see the other's build as stale and rebuild
it on every first use, the other's processes waiting on the lock meanwhile.
Concurrent first uses wait on each other through an ``flock`` on the build folder, which the OS
drops when its holder dies: torch's own lock is a plain file that a process killed mid-build
leaves behind, and every later ``load`` would wait on it forever, so a leftover one found while
holding the flock is removed. AVX2+FMA code where torch itself runs AVX2 or better (detected at
run time), plus the AVX-512 extensions the CPU has where torch runs AVX-512, portable scalar code
elsewhere (each source picks its code on ``__AVX2__`` / ``__AVX512F__`` ...).

A failed build (no compiler, no ninja) is not an error: the result says why, and the caller
falls back to torch ops. ``DEEPINFER_NO_NATIVE_KERNELS=1`` skips every build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.hardware import cpu_isa

DISABLE_ENV = "DEEPINFER_NO_NATIVE_KERNELS"


@dataclass(frozen=True)
class NativeExtension:
    isa: str  # the code it was built with: avx2 | scalar; "" if not loaded
    error: str = ""  # why it is not available, or ""

    @property
    def loaded(self) -> bool:
        return not self.error


# /proc/cpuinfo flag -> gcc flag of the AVX-512 extensions a source may use (``__AVX512VNNI__``,
# ``__AVX512BF16__``, ...), enabled only where torch itself runs AVX-512 and the CPU lists them.
AVX512_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                "avx512dq": "-mavx512dq", "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}


def compiler_flags() -> list[str]:
    """Vector ISA flags for this CPU: AVX2+FMA where torch's own kernels run AVX2 or better, and
    the AVX-512 extensions the CPU lists where torch runs AVX-512 (F, BW, VL and DQ all needed)."""
    capability = torch.backends.cpu.get_cpu_capability()
    isa = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    flags = cpu_isa().flags
    if capability == "AVX512" and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        isa += [gcc for cpu, gcc in AVX512_FLAGS.items() if cpu in flags]
    return ["-O3", "-fopenmp", *isa]


def build_root() -> Path:
    """Where torch keeps built extensions: ``$TORCH_EXTENSIONS_DIR``, else its cache folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_name(stem: str, source: Path, flags: list[str]) -> str:
    """``stem`` plus a key of everything the built library depends on (the source's path too, and
    the text of the headers next to it: the ones a source includes are kept in its folder)."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + str(source.resolve()).encode()
                         + " ".join(flags).encode() + torch.__version__.encode() + sys.version.encode())
    return f"{stem}_{key.hexdigest()[:16]}"


def build_extension(stem: str, source: Path, isa: Callable[[], str]) -> NativeExtension:
    """Build (once per machine) and load ``source``, whose ``TORCH_LIBRARY`` registers its ops;
    ``isa`` asks the loaded library which code it holds. Never raises."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return NativeExtension("", f"disabled by {DISABLE_ENV}")
    flags = compiler_flags()
    try:
        from torch.utils.cpp_extension import load

        name = build_name(stem, source, flags)
        build_dir = build_root() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "deepinfer.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or by the OS if this process dies
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
            load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 build_directory=str(build_dir), is_python_module=False, verbose=False)
        return NativeExtension(isa())
    except Exception as e:  # noqa: BLE001  (any build or load failure means: use the fallback)
        reason = str(e).strip().splitlines()
        return NativeExtension("", f"{source.name} did not build ({reason[0] if reason else type(e).__name__})")
