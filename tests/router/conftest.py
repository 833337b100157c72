"""Fixtures of the router tests: two real workers over the tiny Llama (``router_procs.py``)."""

from __future__ import annotations

import pytest
from router_procs import spawn_worker, wait_healthy


@pytest.fixture(scope="module")
def workers(tiny_llama):
    procs = [spawn_worker(tiny_llama) for _ in range(2)]  # both start at once
    for p in procs:
        wait_healthy(p.url, p.proc, "deepinfer serve")
    yield procs
    for p in procs:
        p.stop()
