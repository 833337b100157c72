"""Scheduler: requests that arrive together and share a prefix nobody has cached yet compute
it once (the others wait for the pages being computed), and requests sharing nothing are not
delayed."""

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PS = 4


def ids(n, g):
    return torch.randint(3, 300, (n,), generator=g).tolist()


def make(tiny_llama, **kw):
    args = dict(page_size=PS, num_pages=1024, max_num_batched_tokens=256, progress=False,
                enable_disk_cache=False, host_cache_gb=0)
    args.update(kw)
    return LLM(str(tiny_llama), **args)


@pytest.mark.parametrize("budget", [256, 64])  # the document in one prefill chunk, or in four
def test_questions_over_one_document_compute_it_once(tiny_llama, budget):
    g = torch.Generator().manual_seed(0)
    doc = ids(200, g)  # 50 pages
    batch = [doc + ids(6, g) for _ in range(8)]
    outs = make(tiny_llama, max_num_batched_tokens=budget).generate(batch, GREEDY)
    # the first request computes the document and its question; the 7 others their question
    assert [o.num_computed_tokens for o in outs] == [206] + [6] * 7
    assert [o.num_cached_tokens for o in outs] == [0] + [200] * 7
    ref = make(tiny_llama, enable_prefix_cache=False).generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_a_request_sharing_nothing_is_not_delayed(tiny_llama):
    g = torch.Generator().manual_seed(1)
    doc = ids(120, g)
    llm = make(tiny_llama)
    eng = llm.engine
    a = eng.add_request(doc + ids(5, g), GREEDY)
    b = eng.add_request(doc + ids(5, g), GREEDY)  # shares the document: waits one step
    c = eng.add_request(ids(60, g), GREEDY)  # shares nothing: runs in the first step
    eng.step()
    assert a.num_computed_tokens == 125 and c.num_computed_tokens == 60
    assert b.num_cached_tokens is None and b.num_computed_tokens == 0
    outs = eng.run_to_completion([a, b, c])
    assert [o.num_computed_tokens for o in outs] == [125, 5, 60]
    assert not eng.kv._computing  # nothing left registered once all finished


def test_an_aborted_computer_releases_its_waiters(tiny_llama):
    g = torch.Generator().manual_seed(2)
    doc = ids(40, g)
    eng = make(tiny_llama, max_num_batched_tokens=16).engine  # the document in 16-token chunks
    a = eng.add_request(doc + ids(5, g), GREEDY)
    b = eng.add_request(doc + ids(5, g), GREEDY)
    eng.step()
    assert a.num_computed_tokens == 16 and eng.kv.joins_computing(b)
    eng.abort(a.request_id)  # b computes the rest of the document itself
    assert not eng.kv._computing and not eng.kv.joins_computing(b)
    out = eng.run_to_completion([b])[0]
    assert (out.num_cached_tokens, out.num_computed_tokens) == (16, 29)
