"""Fixtures of the engine-level tier tests (helpers: ``tier_engine_helpers.py``)."""

from __future__ import annotations

import pytest
from tier_engine_helpers import GREEDY, make


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs with no cache at all, by prompt."""
    llm = make(tiny_llama, enable_prefix_cache=False)
    memo = {}

    def ref(ps):
        missing = [p for p in ps if tuple(p) not in memo]
        for p, o in zip(missing, llm.generate(missing, GREEDY) if missing else []):
            memo[tuple(p)] = o.token_ids
        return [memo[tuple(p)] for p in ps]

    return ref
