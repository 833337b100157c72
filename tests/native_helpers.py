"""Shared by the tests of our C++ kernels (``deepinfer/native_build.py``)."""

from __future__ import annotations

import pytest

from deepinfer.native_build import NativeExtension


def loaded(kernel: NativeExtension) -> NativeExtension:
    """``kernel`` if it built here, else skip the test (no compiler: the fallback tests cover it)."""
    if not kernel.loaded:
        pytest.skip(kernel.error)
    return kernel
