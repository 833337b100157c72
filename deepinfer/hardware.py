"""What the CPU can do, detected at run time, and the dtype ``--dtype auto`` picks from it.

bf16 pays on a CPU only where matmuls run natively in bf16: AMX tiles (``amx_bf16``, Sapphire
Rapids and later) or AVX512-BF16 dot products (``avx512_bf16``, Cooper Lake, Zen 4). Elsewhere
(e.g. AVX2-only CPUs) torch emulates bf16 by converting to fp32 around each kernel, which is
slower than fp32 itself, so auto picks fp32 there. On CUDA auto picks bf16.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matmul


@dataclass(frozen=True)
class CpuIsa:
    model: str  # "model name" from /proc/cpuinfo
    capability: str  # torch's vector ISA level (torch.backends.cpu.get_cpu_capability())
    bf16_flags: tuple[str, ...]  # which of BF16_FLAGS the CPU reports
    flags: frozenset[str] = frozenset()  # every flag /proc/cpuinfo lists (native kernels' ISA choice)

    @property
    def native_bf16(self) -> bool:
        return bool(self.bf16_flags)

    def describe(self) -> str:
        bf16 = "+".join(self.bf16_flags) if self.bf16_flags else "no native bf16"
        return f"{self.model} ({self.capability}, {bf16})"


def parse_cpuinfo(text: str, capability: str) -> CpuIsa:
    """``CpuIsa`` from the text of /proc/cpuinfo (first processor's entries)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return CpuIsa(model=fields.get("model name", "unknown CPU"), capability=capability,
                  bf16_flags=tuple(f for f in BF16_FLAGS if f in flags), flags=frozenset(flags))


@cache
def cpu_isa() -> CpuIsa:
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.is_file() else ""
    return parse_cpuinfo(text, torch.backends.cpu.get_cpu_capability())


def auto_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16 matmul, fp32 on other CPUs."""
    if device.type == "cuda" or (device.type == "cpu" and cpu_isa().native_bf16):
        return torch.bfloat16
    return torch.float32


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"CPU {cpu_isa().describe()}"
    return device.type


def lscpu_model() -> str:
    """``lscpu``'s model name, printed with every benchmark result (the CPU differs between
    machines, and figures are only comparable on one)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return cpu_isa().model
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), cpu_isa().model)
