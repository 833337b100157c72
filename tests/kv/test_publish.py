"""``kv/publish.py``: a prompt's full pages made durable in a real networked store, including
the ones no write-through queued (write-back policy): written from L1 and acknowledged."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.publish import StorePublisher
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

PS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def test_pages_no_write_queued_are_written_from_l1_and_acknowledged(store_service, tiny_llama):
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=256, progress=False, host_cache_gb=0,
              enable_disk_cache=False, cache_policy="write_back", kv_store=store_service.url,
              kv_store_options=store_service.options)
    eng = llm.engine
    pub = StorePublisher(eng.kv, eng.tiers)
    prompt = torch.randint(3, 250, (43,), generator=torch.Generator().manual_seed(7)).tolist()
    plan = pub.plan(prompt, None)
    assert len(plan.keys) == 43 // PS
    assert pub.in_store(plan.keys) == [False] * 10
    llm.generate(prompt, SamplingParams(max_tokens=1, prefill_only=True))
    pub.wait_written(plan.keys)
    assert pub.in_store(plan.keys) == [False] * 10  # write-back: nothing went down yet
    put = pub.capture(plan, [0, 3, 9])
    assert put is not None and put() == [True] * 3
    assert pub.in_store(plan.keys) == [i in (0, 3, 9) for i in range(10)]
    put = pub.capture(plan, list(range(10)))
    assert put() == [True] * 10 and pub.in_store(plan.keys) == [True] * 10
    # a prompt the tree never saw: nothing in L1 to publish
    assert pub.capture(pub.plan(prompt[::-1], None), list(range(10))) is None
    # what was published is what a fresh engine reads back (checked like any page)
    other = LLM(str(tiny_llama), page_size=PS, num_pages=256, progress=False, host_cache_gb=0,
                enable_disk_cache=False, kv_store=store_service.url,
                kv_store_options=store_service.options)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = other.generate(prompt, greedy)[0]
    assert got.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 40}
    assert got.token_ids == llm.generate(prompt, greedy)[0].token_ids
    eng.shutdown()
    other.engine.shutdown()


def test_a_prefill_worker_needs_a_store(tiny_llama):
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=64, progress=False, host_cache_gb=0,
              enable_disk_cache=False)
    with pytest.raises(ValueError, match="--kv-store"):
        StorePublisher(llm.engine.kv, llm.engine.tiers)
