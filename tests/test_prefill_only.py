"""``SamplingParams.prefill_only``: the engine computes and caches the prompt's KV and ends the
request without sampling (a prefill worker's request, server/pd.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

PS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefill_only_caches_the_prompt_and_samples_nothing(tiny_llama):
    llm = LLM(str(tiny_llama), page_size=PS, num_pages=256, max_num_batched_tokens=16,
              progress=False, enable_disk_cache=False, host_cache_gb=0)
    prompt = torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prefill_only=True))[0]
    assert out.finish_reason == "prefill" and out.token_ids == []
    assert out.num_cached_tokens == 0 and out.num_computed_tokens == 37  # in chunks of 16
    assert llm.engine.stats()["computed_prompt_tokens"] == 37
    assert not llm.engine.requests  # nothing left behind
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    after = llm.generate(prompt, greedy)[0]
    assert after.num_cached_tokens == 36  # every full page (the last token is always computed)
    fresh = LLM(str(tiny_llama), page_size=PS, num_pages=256, progress=False,
                enable_prefix_cache=False, enable_disk_cache=False, host_cache_gb=0)
    assert after.token_ids == fresh.generate(prompt, greedy)[0].token_ids
    llm.engine.shutdown()
    fresh.engine.shutdown()
