"""n > 1 on a sliding-window model: the samples share the prompt's pages and each gets its own
copy of the ring, so the prompt is computed once and every sample equals its seed run alone."""

import pytest
from test_window_reuse import hybrid, ids, make  # noqa: F401 (hybrid: the fixture)

from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = ids(30, 1)  # past the window (8), ends inside a page (30 = 7 pages + 2)


def sampling(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["radix", "no-cache"])
def test_n4_computes_the_prompt_once_and_each_sample_equals_its_seed_alone(hybrid,
                                                                           prefix_cache):
    llm = make(hybrid, enable_prefix_cache=prefix_cache)
    outs = llm.generate(PROMPT, sampling(7, n=4))
    stats = llm.engine.stats()
    assert stats["computed_prompt_tokens"] == len(PROMPT)  # one prefill for four samples
    assert outs[0].num_computed_tokens == len(PROMPT)
    assert all(o.num_cached_tokens == len(PROMPT) and o.num_computed_tokens == 0
               for o in outs[1:])
    assert len({tuple(o.token_ids) for o in outs}) > 1  # they are different samples
    alone = make(hybrid, enable_prefix_cache=False)
    for k, o in enumerate(outs):  # sample k draws with seed + k, from its own ring
        assert o.token_ids == alone.generate(PROMPT, sampling(7 + k))[0].token_ids, k
    assert llm.engine.stats()["window_ring_pages_used"] == 0  # every ring went back
