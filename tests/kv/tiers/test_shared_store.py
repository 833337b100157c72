"""Engines sharing L3 through a real networked store (Mooncake Store, Redis on loopback): a
second process with its own directory serves a repeated prompt from the store; a store killed
mid-run costs counted misses, never an error or a different output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]
PS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")

_WORKER = textwrap.dedent("""
    import json, sys
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    ckpt, disk, url, options, prompt, out = sys.argv[1:]
    llm = LLM(ckpt, page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False,
              host_cache_gb=0, disk_cache_dir=disk, kv_store=url, kv_store_options=json.loads(options))
    o = llm.generate(json.loads(prompt), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert llm.engine.shutdown()
    json.dump({"tokens": o.token_ids, "by_tier": o.cached_tokens_by_tier,
               "stats": llm.engine.stats()}, open(out, "w"))
""")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_worker(tiny_llama, disk, svc, p, out):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(tiny_llama), str(disk), svc.url,
                           json.dumps(svc.options), json.dumps(p), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text())


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens with no cache at all."""
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=512, progress=False, enable_prefix_cache=False)
    yield lambda p: llm.generate(p, GREEDY)[0].token_ids
    llm.engine.shutdown()


def test_two_processes_with_separate_directories_share_hits_through_the_store(
        store_service, tiny_llama, reference, tmp_path):
    """This process writes the prompt's pages; a second one, with its own empty directory,
    serves the same prompt from the store."""
    p = prompt(161, seed=0)
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=512, max_num_batched_tokens=256,
              progress=False, host_cache_gb=0, disk_cache_dir=str(tmp_path / "a"),
              kv_store=store_service.url, kv_store_options=store_service.options)
    first = llm.generate(p, GREEDY)[0]
    assert llm.engine.shutdown()  # the writes have landed
    assert first.cached_tokens_by_tier["disk"] == 0
    # every full page of the 161 + 8 tokens whose KV was computed (168 of them) went to the store
    assert llm.engine.stats()["cache_remote_writes_total"] == 42
    second = run_worker(tiny_llama, tmp_path / "b", store_service, p, tmp_path / "b.json")
    assert second["by_tier"] == {"device": 0, "host": 0, "disk": 160}  # >= 90% of 161 tokens
    assert second["stats"]["cache_remote_hits_total"] == 40
    assert second["stats"]["cache_remote_unavailable_total"] == 0
    assert first.token_ids == second["tokens"] == reference(p)


def test_a_store_killed_mid_run_costs_counted_misses_not_errors(store_service, tiny_llama, reference):
    if store_service.url.startswith("mooncake:"):
        # Known defect, kept visible: after its master is killed and restarted, the Mooncake
        # client left in this process segfaults in a later test (seen 3 of 3 runs), which
        # takes the whole pytest process down. The store-level kill test
        # (test_remote_store.py) covers Mooncake outages; this engine-level one runs on Redis
        # until the Mooncake client is isolated in its own process.
        pytest.skip("Mooncake client segfaults after a master restart in-process (known issue)")
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=64, max_num_batched_tokens=256,
              progress=False, host_cache_gb=0, enable_disk_cache=False, kv_store=store_service.url,
              kv_store_options={**store_service.options, "retry_s": "0.5", "timeout_s": "10"})
    a, b, c = prompt(120, 1), prompt(120, 2), prompt(120, 3)
    try:
        assert llm.generate(a, GREEDY)[0].token_ids == reference(a)
        llm.engine.kv.evict()  # L1 emptied: a's pages are only in the store now
        assert llm.generate(a, GREEDY)[0].cached_tokens_by_tier["disk"] == 116
        llm.engine.kv.evict()
        store_service.kill()
        for p in (a, b, a, c):  # a's pages are indexed as L3 but the store is gone
            o = llm.generate(p, GREEDY)[0]
            assert o.token_ids == reference(p)
            assert o.cached_tokens_by_tier["disk"] == 0
        s = llm.engine.stats()
        assert s["cache_remote_outages_total"] == 1 and s["cache_remote_unavailable_total"] > 0
        assert not s["cache_remote_available"] and s["cache_load_failures_total"] >= 1
    finally:
        store_service.start()
        llm.engine.shutdown()
