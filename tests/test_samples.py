"""n > 1 and best_of: one prefill, the samples share the prompt's pages, each sample's KV is
right (its log-probs match transformers'), and the cache accounting says so."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer.errors import RequestError
from deepinfer.kv.radix import DEVICE
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 99, 230, 64, 8, 8, 31, 77, 12, 150, 201, 9, 44, 3, 60, 61]  # 4.5 pages


def make(tiny_llama, **kw):
    args = dict(page_size=4, num_pages=256, progress=False, enable_disk_cache=False)
    return LLM(str(tiny_llama), **{**args, **kw})


def assert_pages_back(llm):
    kv = llm.engine.kv
    cached = kv.tree.evictable_pages(DEVICE) if kv.tree is not None else 0
    assert kv.num_free_pages + cached == llm.engine.runner.pool.allocator.num_pages - 1


def assert_logprobs_match_transformers(tiny_llama, outs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with torch.no_grad():
        for o in outs:
            ids = PROMPT + o.token_ids
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            ref = [float(logp[len(PROMPT) - 1 + t, tok]) for t, tok in enumerate(o.token_ids)]
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(ref),
                                       atol=2e-4, rtol=0)


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["radix", "no-cache"])
def test_n4_computes_the_prompt_once_and_each_sample_is_right(tiny_llama, prefix_cache):
    llm = make(tiny_llama, enable_prefix_cache=prefix_cache)
    p = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True,
                       logprobs=0)
    outs = llm.generate(PROMPT, p)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # they are different samples
    stats = llm.engine.stats()
    assert stats["computed_prompt_tokens"] == len(PROMPT)  # one prefill for four samples
    assert stats["prefix_cache_queries"] == len(PROMPT)  # one lookup
    assert outs[0].num_computed_tokens == len(PROMPT) and outs[0].num_cached_tokens == 0
    for o in outs[1:]:  # the others got the whole prompt from the shared prefill
        assert o.num_cached_tokens == len(PROMPT) and o.num_computed_tokens == 0
    assert_logprobs_match_transformers(tiny_llama, outs)
    assert_pages_back(llm)


def test_seeded_samples_are_reproducible_and_the_first_is_the_n1_sample(tiny_llama):
    llm = make(tiny_llama)
    p = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(PROMPT, p)]
    b = [o.token_ids for o in llm.generate(PROMPT, p)]  # now with the prompt cached
    one = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5,
                                              ignore_eos=True))[0].token_ids
    assert a == b and a[0] == one


def test_greedy_samples_equal_the_greedy_output(tiny_llama):
    llm = make(tiny_llama)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = llm.generate(PROMPT, greedy)[0].token_ids
    outs = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=0.0,
                                               ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref] * 3


def test_best_of_returns_the_n_most_likely_of_its_samples(tiny_llama):
    llm = make(tiny_llama)
    all4 = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3,
                                               ignore_eos=True, logprobs=0))
    best = llm.generate(PROMPT, SamplingParams(n=2, best_of=4, max_tokens=6, temperature=1.0,
                                               seed=3, ignore_eos=True))
    ranked = sorted(all4, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.index for o in best] == [0, 1]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    for o in all4:
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs), abs=1e-4)
    assert_pages_back(llm)


def test_abort_ends_every_sample_and_frees_their_pages(tiny_llama):
    llm = make(tiny_llama)
    eng = llm.engine
    req = eng.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, temperature=1.0,
                                                 ignore_eos=True))
    while req.group is None:
        eng.step()
    eng.step()
    eng.abort(req.request_id)
    assert all(m.finish_reason == "abort" for m in req.group.members)
    assert not eng.has_unfinished()
    assert_pages_back(llm)


def test_too_many_samples_is_a_request_error(tiny_llama):
    llm = make(tiny_llama, max_num_seqs=4)
    with pytest.raises(RequestError) as e:
        llm.generate(PROMPT, SamplingParams(n=2, best_of=5))
    assert e.value.field == "best_of"
    with pytest.raises(RequestError) as e:
        llm.generate(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.field == "logit_bias"


def test_a_pool_too_small_for_the_copies_still_gives_right_samples(tiny_llama):
    """7 usable pages, the prompt takes 5: the third extra sample finds no page for its copy,
    waits and recomputes from the cache; greedy samples all equal the greedy output."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = make(tiny_llama).generate(PROMPT, greedy)[0].token_ids
    llm = make(tiny_llama, num_pages=8, max_model_len=28)
    outs = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=6, temperature=0.0,
                                               ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref] * 4
    assert llm.engine.stats()["computed_prompt_tokens"] > len(PROMPT)  # someone recomputed
    assert_pages_back(llm)


def test_abort_after_the_first_sample_ended_still_ends_the_others(tiny_llama):
    llm = make(tiny_llama)
    eng = llm.engine
    req = eng.add_request(PROMPT, SamplingParams(n=2, max_tokens=40, temperature=1.0,
                                                 ignore_eos=True))
    while req.group is None:
        eng.step()
    eng.scheduler.finish(req, "stop")  # as if the first sample had hit a stop token
    eng.requests.pop(req.request_id)
    eng.abort(req.request_id)
    assert req.group.members[1].finish_reason == "abort" and not eng.has_unfinished()
    assert_pages_back(llm)
