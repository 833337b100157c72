"""Shared fixtures of the benchmark tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run from a checkout without an installed package
    sys.path.insert(0, str(_REPO))


def _traces_dir() -> Path | None:
    env = os.environ.get("DEEPINFER_TRACES")
    for p in ([Path(env)] if env else []) + [_REPO.parent / "shared" / "traces"]:
        if p.is_dir():
            return p
    return None


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    d = _traces_dir()
    if d is None:
        pytest.skip("real traces not present (../shared/traces or $DEEPINFER_TRACES)")
    return d


@pytest.fixture(scope="session")
def real_file(traces_dir: Path):
    """``real_file(name)``: path of a file under the traces folder, or skip the test."""

    def get(name: str) -> Path:
        p = traces_dir / name
        if not p.exists():
            pytest.skip(f"{name} not present")
        return p

    return get
