"""ISA detection and the dtype ``--dtype auto`` picks from it."""

from __future__ import annotations

import torch

from deepinfer import hardware
from deepinfer.config import EngineConfig

AMX = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n\nprocessor\t: 1\nflags\t: amx_bf16\n"


def test_parse_cpuinfo_finds_native_bf16_flags_of_the_first_processor():
    amx = hardware.parse_cpuinfo(AMX, "AVX512")
    assert amx.native_bf16 and amx.bf16_flags == ("amx_bf16", "avx512_bf16")
    assert "Xeon" in amx.describe() and "amx_bf16" in amx.describe()
    zen3 = hardware.parse_cpuinfo(ZEN3, "AVX2")
    assert not zen3.native_bf16 and zen3.model == "AMD EPYC 7B13"
    assert "no native bf16" in zen3.describe()


def test_auto_dtype_follows_the_isa(monkeypatch):
    monkeypatch.delenv("DEEPINFER_DTYPE", raising=False)  # the suite pins tests to one dtype
    cpu = torch.device("cpu")
    for text, want in ((AMX, torch.bfloat16), (ZEN3, torch.float32)):
        monkeypatch.setattr(hardware, "cpu_isa", lambda t=text: hardware.parse_cpuinfo(t, "AVX2"))
        assert hardware.auto_dtype(cpu) == want
        assert EngineConfig(device="cpu").torch_dtype() == want
    assert hardware.auto_dtype(torch.device("cuda")) == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="float32").torch_dtype() == torch.float32


def test_this_machine():
    isa = hardware.cpu_isa()
    assert isa.capability == torch.backends.cpu.get_cpu_capability()
    want = torch.bfloat16 if isa.native_bf16 else torch.float32
    assert hardware.auto_dtype(torch.device("cpu")) == want
