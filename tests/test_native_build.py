"""The shared build of our C++ sources (``native_build.py``): a stale lock of a killed build does
not hang the next, the cache name follows the source, and a disabled or failing build is a result
that says why, never an exception."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from deepinfer import native_build

PROBE = """#include <torch/library.h>
#include <string>
std::string probe_isa() { return "probe"; }
TORCH_LIBRARY(deepinfer_build_probe_%s, m) { m.def("isa() -> str", &probe_isa); }
"""


def _probe(tmp_path: Path, tag: str) -> Path:
    source = tmp_path / f"probe_{tag}.cpp"
    source.write_text(PROBE % tag)
    return source


def test_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's build lock is a plain file: a process killed mid-build leaves it, and torch's own
    ``load`` would then wait forever. A trivial source keeps the build short."""
    import torch

    monkeypatch.delenv(native_build.DISABLE_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = _probe(tmp_path, "lock")
    build_dir = native_build.build_root() / native_build.build_name("probe", source, native_build.compiler_flags())
    assert build_dir.is_relative_to(tmp_path)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # what the killed build left
    done: list = []
    worker = threading.Thread(daemon=True, target=lambda: done.append(
        native_build.build_extension("probe", source, lambda: torch.ops.deepinfer_build_probe_lock.isa())))
    worker.start()
    worker.join(300)
    assert done, "the build waited on a dead process's lock"
    assert done[0] == native_build.NativeExtension("probe"), done[0].error
    assert list(build_dir.glob("*.so"))


def test_name_changes_with_the_source(tmp_path):
    a, b = _probe(tmp_path, "a"), _probe(tmp_path, "b")
    flags = native_build.compiler_flags()
    assert native_build.build_name("x", a, flags) == native_build.build_name("x", a, flags)
    assert native_build.build_name("x", a, flags) != native_build.build_name("x", b, flags)
    assert native_build.build_name("x", a, flags) != native_build.build_name("x", a, [*flags, "-g"])
    # the same text in another checkout: its own folder (a shared one is rebuilt at every switch)
    (tmp_path / "other").mkdir()
    same = tmp_path / "other" / a.name
    same.write_bytes(a.read_bytes())
    assert native_build.build_name("x", a, flags) != native_build.build_name("x", same, flags)


def test_name_changes_with_a_header_next_to_the_source(tmp_path):
    source, flags = _probe(tmp_path, "h"), native_build.compiler_flags()
    alone = native_build.build_name("x", source, flags)
    header = tmp_path / "layout.h"
    header.write_text("constexpr int ROWS = 8;\n")
    with_header = native_build.build_name("x", source, flags)
    header.write_text("constexpr int ROWS = 16;\n")
    assert len({alone, with_header, native_build.build_name("x", source, flags)}) == 3


def test_disabled_by_env(tmp_path, monkeypatch):
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    result = native_build.build_extension("probe", _probe(tmp_path, "off"), lambda: "never asked")
    assert not result.loaded and native_build.DISABLE_ENV in result.error


def test_build_failure_is_a_result(tmp_path, monkeypatch):
    monkeypatch.delenv(native_build.DISABLE_ENV, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "no kernel today"\n')
    result = native_build.build_extension("broken", broken, lambda: pytest.fail("isa of a failed build"))
    assert not result.loaded and "broken.cpp did not build" in result.error


@pytest.mark.parametrize(("capability", "flags", "expected"), [
    ("AVX2", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, []),  # torch runs AVX2: no AVX-512 code
    ("AVX512", {"avx512f", "avx512bw", "avx512vl"}, []),  # DQ missing: none of it
    ("AVX512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]),
    ("AVX512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"},
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"]),
])
def test_avx512_flags_follow_torch_and_the_cpu(monkeypatch, capability, flags, expected):
    from deepinfer.hardware import parse_cpuinfo

    isa = parse_cpuinfo("flags\t: avx2 fma f16c " + " ".join(sorted(flags)), capability)
    monkeypatch.setattr(native_build, "cpu_isa", lambda: isa)
    monkeypatch.setattr(native_build.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    got = native_build.compiler_flags()
    assert got[:5] == ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
    assert got[5:] == expected
