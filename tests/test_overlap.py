"""Overlap scheduling (deepinfer/overlap.py): the same outputs with it on and off, for every
kind of request and under preemption, aborts, prefix hits and sliding-window rings, and no page
is lost or reused early."""

import argparse

import pytest
import torch
from transformers import Gemma3TextConfig

from deepinfer.cli import add_engine_args, engine_config
from deepinfer.kv.pool import PageAllocator
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tiny_checkpoints import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(n, length, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 300, (shared,), generator=g).tolist()
    return [head + torch.randint(3, 300, (length - shared,), generator=g).tolist() for _ in range(n)]


def make(path, overlap, **kw):
    args = dict(page_size=4, num_pages=512, max_num_batched_tokens=24, progress=False,
                enable_disk_cache=False, overlap_schedule=overlap)
    args.update(kw)
    return LLM(str(path), **args)


def summary(outs):
    """What a request returns, but for logprob values (see ``logprob_values``). Hit counts may
    differ: a page is cached when its step lands, one step later with overlap, so a request
    admitted meanwhile can hit less."""
    for o in outs:
        assert o.num_cached_tokens + o.num_replayed_tokens + o.num_computed_tokens == o.num_prompt_tokens
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs is None,
             None if o.top_logprobs is None else [[t for t, _ in top] for top in o.top_logprobs])
            for o in outs]


def logprob_values(outs):
    """Logprobs agree to float rounding, not bit for bit: the extra rows that overlap adds to a
    batch change the matmul shapes (and, with the cache on, a prefix may be cached vs recomputed)."""
    return torch.tensor([v for o in outs if o.logprobs for v in o.logprobs])


def mixed_params(llm):
    tok = llm.engine.tokenizer
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    ref = llm.generate(prompts(1, 11, seed=50)[0], greedy)[0]
    return [
        greedy,
        SamplingParams(max_tokens=7, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True),  # seed from engine seed + id
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ref.token_ids[3]]),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[tok.decode(ref.token_ids[4:6])]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]


@pytest.mark.parametrize("prefix_cache,quantization", [(False, "none"), (True, "none"), (True, "int4")])
def test_outputs_identical_with_overlap_on_and_off(tiny_llama, prefix_cache, quantization):
    """(int4: the decode steps run the native decode stack, models/llama_native.py)"""
    stop_prompt = prompts(1, 11, seed=50)[0]  # the stop kinds (params 3, 4) are set for this one
    ps = prompts(3, 30, seed=1, shared=12) + [stop_prompt, stop_prompt] + prompts(1, 17, seed=2)
    results = []
    for overlap in (False, True):
        llm = make(tiny_llama, overlap, enable_prefix_cache=prefix_cache, quantization=quantization)
        assert (llm.engine.runner.decode_stack is not None) == (quantization == "int4")
        params = mixed_params(llm)
        first = llm.generate(ps, params[0])
        per_kind = [llm.generate(ps[i], p)[0] for i, p in enumerate(params)]
        batched = [llm.engine.add_request(p, sp) for p, sp in zip(ps, params)]
        out = llm.engine.run_to_completion(batched)
        results.append(first + per_kind + out)
        llm.engine.shutdown()
    assert summary(results[0]) == summary(results[1])
    assert torch.allclose(logprob_values(results[0]), logprob_values(results[1]), atol=1e-4)
    stops = [o.finish_reason for o in results[1]]
    assert "stop" in stops and "length" in stops


def test_overlap_with_preemption_and_no_lost_pages(tiny_llama):
    ps = prompts(6, 40, seed=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in make(tiny_llama, False, enable_prefix_cache=False,
                                     max_num_batched_tokens=256).generate(ps, params)]
    tight = make(tiny_llama, True, num_pages=45, max_model_len=160, enable_prefix_cache=False,
                 max_num_batched_tokens=256)
    assert [o.token_ids for o in tight.generate(ps, params)] == ref
    eng = tight.engine
    assert eng.kv.stats.preemptions > 0
    assert not eng.has_unfinished()
    assert eng.kv.num_free_pages == eng.runner.pool.allocator.num_pages - 1  # every page back


def test_abort_while_in_flight(tiny_llama):
    ps = prompts(3, 20, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ref = make(tiny_llama, False, enable_prefix_cache=False).generate([ps[0], ps[2]], params)
    llm = make(tiny_llama, True, enable_prefix_cache=False)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in ps]
    for _ in range(4):
        eng.step()
    assert eng.overlap.in_flight is not None and not reqs[1].is_finished
    eng.abort(reqs[1].request_id)
    outs = eng.run_to_completion([reqs[0], reqs[2]])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert reqs[1].finish_reason == "abort" and len(reqs[1].output_token_ids) < 10
    eng.overlap.drain()
    assert eng.kv.num_free_pages == eng.runner.pool.allocator.num_pages - 1


def test_overlap_on_sliding_window_rings(tmp_path_factory):
    cfg = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    cfg.architectures = ["Gemma3ForCausalLM"]
    path = make_checkpoint(tmp_path_factory.mktemp("tiny_gemma3_overlap"), cfg)
    ps = prompts(3, 26, seed=4, shared=12)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = make(path, overlap, host_cache_gb=0, max_num_seqs=4)
        first = llm.generate(ps, params)
        repeat = llm.generate(ps[:1], params)
        assert repeat[0].num_cached_tokens > 0  # a repeat hits the cache
        runs.append(summary(first + repeat))
    assert runs[0] == runs[1]


def test_requests_that_need_each_token_step_in_sync(tiny_llama):
    """Penalties read the last token, n > 1 forks after the prompt: with such a request in the
    engine, overlap falls back to plain steps, and outputs still match."""
    ps = prompts(3, 20, seed=6)
    kinds = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
    runs = []
    for overlap in (False, True):
        llm = make(tiny_llama, overlap, enable_prefix_cache=False)
        reqs = [llm.engine.add_request(p, sp) for p, sp in zip(ps, kinds)]
        runs.append(summary(llm.engine.run_to_completion(reqs)))
    assert runs[0] == runs[1]
    assert len(runs[1]) == 4  # the n=2 request returned both samples


@pytest.mark.parametrize("kind", [dict(n=2, seed=3), dict(n=2, best_of=3, logprobs=0)],
                         ids=["n=2", "best_of=3"])
def test_forking_request_alone(tiny_llama, kind):
    """A request that forks after its prompt is the only one: every sample is returned, the
    same as without overlap (it forks in a plain step, the samples then decode overlapped)."""
    params = SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True, **kind)
    runs = []
    for overlap in (False, True):
        llm = make(tiny_llama, overlap, enable_prefix_cache=False)
        runs.append(summary(llm.generate(prompts(2, 18, seed=9), params)))
        assert llm.engine.kv.num_free_pages == llm.engine.runner.pool.allocator.num_pages - 1
    assert runs[0] == runs[1]
    assert len(runs[1]) == 4


def test_cli_flag():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--overlap-schedule"])).overlap_schedule
    assert not engine_config(p.parse_args([])).overlap_schedule


def test_allocator_parks_frees_while_a_step_is_in_flight():
    a = PageAllocator(6)
    pages = a.alloc(3)
    a.hold_frees()
    a.free(pages[:2])
    assert a.num_free == 2  # parked, not reusable yet
    held = a.take_held()
    assert sorted(held) == sorted(pages[:2]) and a.take_held() == []
    a.free(pages[2:])
    a.return_pages(held)  # the step that could use them landed
    assert a.num_free == 4
    a.release_hold()  # nothing in flight: the rest comes back and frees are immediate again
    assert a.num_free == 5
    a.free(a.alloc(1))
    assert a.num_free == 5
