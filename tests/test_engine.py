"""Engine behaviour on a tiny random Llama: equal outputs however the work is split or cached."""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer.errors import RequestError
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n, length, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 300, (shared,), generator=g).tolist()
    return [head + torch.randint(3, 300, (length - shared,), generator=g).tolist() for _ in range(n)]


def make(tiny_llama, **kw):
    # L2 stays on (its default); L3 is off: tests never write to the user's cache folder
    args = dict(page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False,
                enable_disk_cache=False)
    args.update(kw)
    return LLM(str(tiny_llama), **args)


def tokens(outs):
    return [o.token_ids for o in outs]


def test_greedy_equals_transformers_generate(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ps = prompts(3, 21, seed=1)
    outs = make(tiny_llama).generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref


def test_batch_equals_one_at_a_time(tiny_llama):
    ps = prompts(6, 30, seed=2)
    llm = make(tiny_llama, enable_prefix_cache=False)
    batched = tokens(llm.generate(ps, GREEDY))
    single = [llm.generate(p, GREEDY)[0].token_ids for p in ps]
    assert batched == single


def test_chunked_equals_unchunked(tiny_llama):
    ps = prompts(3, 90, seed=3)
    whole = tokens(make(tiny_llama, max_num_batched_tokens=512).generate(ps, GREEDY))
    chunked = tokens(make(tiny_llama, max_num_batched_tokens=16).generate(ps, GREEDY))
    assert whole == chunked


def test_prefix_cache_hits_and_equals_no_cache(tiny_llama):
    ps = prompts(4, 60, seed=4, shared=40)
    off = make(tiny_llama, enable_prefix_cache=False)
    on = make(tiny_llama)
    first = on.generate(ps[0], GREEDY)[0]
    assert first.num_cached_tokens == 0 and first.num_computed_tokens == 60
    rest = on.generate(ps[1:], GREEDY)
    for o in rest:  # the shared 40 tokens are 10 full pages
        assert o.num_cached_tokens == 40 and o.num_computed_tokens == 20
    assert [first.token_ids] + tokens(rest) == tokens(off.generate(ps, GREEDY))
    # the next turn contains this reply: prompt + generated tokens are cached
    turn2 = ps[0] + first.token_ids + prompts(1, 9, seed=5)[0]
    o2 = on.generate(turn2, GREEDY)[0]
    assert o2.num_cached_tokens == (len(ps[0]) + len(first.token_ids) - 1) // 4 * 4
    assert o2.token_ids == off.generate(turn2, GREEDY)[0].token_ids


def test_whole_prompt_cached_still_computes_one_token(tiny_llama):
    llm = make(tiny_llama)
    p = prompts(1, 32, seed=6)[0]
    a = llm.generate(p, GREEDY)[0]
    b = llm.generate(p, GREEDY)[0]
    assert b.num_cached_tokens == 28 and b.num_computed_tokens == 4
    assert a.token_ids == b.token_ids


def test_preemption_with_slow_tier_loads_finishes(tiny_llama):
    """A preempted request comes back with its evicted pages in L2; while loads are slow, the
    head of the queue once waited for pages that later requests' finished loads held (adopted
    only when the scheduler reached them), so with nothing running the engine spun forever."""
    ps = prompts(6, 40, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = tokens(make(tiny_llama, enable_prefix_cache=False).generate(ps, params))
    tight = make(tiny_llama, num_pages=45, max_model_len=160)
    backend = tight.engine.kv.tiers.backend
    start = backend.start_load
    backend.start_load = lambda job: threading.Timer(0.05, start, args=(job,)).start()
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(tight.generate(ps, params)), daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the engine stopped making progress"
    assert tokens(out) == ref
    assert tight.engine.kv.stats.preemptions > 0 and tight.engine.kv.stats.loads > 0


def test_eviction_with_tiny_pool(tiny_llama):
    ps = prompts(8, 40, seed=7, shared=16)
    ref = tokens(make(tiny_llama, enable_prefix_cache=False).generate(ps, GREEDY))
    small = make(tiny_llama, num_pages=40, max_model_len=128, max_num_seqs=2)
    outs = [small.generate(p, GREEDY)[0] for p in ps + ps]
    assert tokens(outs) == ref + ref
    assert small.engine.kv.stats.evicted_pages > 0


def test_preemption_gives_identical_output(tiny_llama):
    ps = prompts(6, 40, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = tokens(make(tiny_llama, enable_prefix_cache=False).generate(ps, params))
    tight = make(tiny_llama, num_pages=45, max_model_len=160)
    assert tokens(tight.generate(ps, params)) == ref
    assert tight.engine.kv.stats.preemptions > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    llm = make(tiny_llama)
    ps = prompts(3, 20, seed=9)
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = llm.generate(ps[0], sp)[0].token_ids
    batched = llm.generate(ps, sp)[0].token_ids
    assert alone == batched
    k1 = SamplingParams(max_tokens=10, temperature=0.8, top_k=1, ignore_eos=True)
    assert llm.generate(ps[1], k1)[0].token_ids == llm.generate(ps[1], GREEDY)[0].token_ids[:10]


def test_stop_conditions_and_logprobs(tiny_llama):
    llm = make(tiny_llama)
    p = prompts(1, 20, seed=10)[0]
    full = llm.generate(p, GREEDY)[0]
    stop_tok = full.token_ids[3]
    o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok],
                                       ignore_eos=True, logprobs=2))[0]
    assert o.finish_reason == "stop" and o.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    assert len(o.logprobs) == len(o.token_ids) and all(lp <= 0 for lp in o.logprobs)
    assert all(len(t) == 2 for t in o.top_logprobs)
    text = llm.tokenizer.decode(full.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        o = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop=[stop], ignore_eos=True))[0]
        assert o.finish_reason == "stop" and stop not in o.text


@pytest.mark.parametrize("bad,field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[[]]), "prompt"),
    (dict(prompt="x" * 5, max_tokens=10_000), "max_tokens"),
    (dict(prompt=list(range(3, 600)) * 2), "prompt"),
    (dict(prompt=[10**6]), "prompt"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_llama, bad, field):
    llm = make(tiny_llama, max_model_len=512)
    bad = dict(bad)
    prompt = bad.pop("prompt")
    with pytest.raises(RequestError) as err:
        llm.generate(prompt, SamplingParams(**{"max_tokens": 4, **bad}))
    assert err.value.field == field
    assert len(llm.generate("hello world", GREEDY)[0].token_ids) == 12
