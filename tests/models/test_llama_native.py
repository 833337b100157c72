"""The native decode stack (``models/llama_native.py``) end to end: which models and steps take it,
and the tokens it gives (its bits, op by op, are checked in test_decode_ops.py)."""

import pytest
from deepinfer.llm import LLM
from deepinfer.models.llama_native import NativeDecodeStack
from deepinfer.sampling_params import SamplingParams
from tiny_checkpoints import make_checkpoint, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the cache", "a much longer prompt about the cache and the pages it holds", "pages"]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), quantization="int4", progress=False, host_cache_gb=0, enable_disk_cache=False, **kwargs)


def test_decode_steps_take_the_stack_and_give_the_eager_tokens(tiny_llama, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager = engine(tiny_llama, enforce_eager=True)
    assert eager.engine.runner.decode_stack is None
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]

    llm = engine(tiny_llama)
    stack = llm.engine.runner.decode_stack
    assert stack is not None
    seen = []  # (decodes, whether the stack ran) per step
    runs = NativeDecodeStack.runs

    def spied(self, batch):
        ran = runs(self, batch)
        seen.append((batch.num_decodes, batch.num_tokens, ran))
        return ran

    monkeypatch.setattr(NativeDecodeStack, "runs", spied)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert any(ran and decodes == 3 for decodes, _, ran in seen)  # the three decoding together
    assert all(ran == (decodes == tokens) for decodes, tokens, ran in seen)  # a prefill: the modules


def test_stack_tokens_the_same_on_one_or_two_threads(tiny_llama, threads):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for n in (1, 2):
        llm = engine(tiny_llama, threads=n, fixed_threads=True)
        assert llm.engine.runner.decode_stack is not None
        outs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
    assert outs[0] == outs[1]


def test_layers_it_cannot_run_keep_the_modules(tmp_path):
    cfg = tiny_llama_config(cross_layer_kv_share=2)  # layer 1 reads layer 0's cache: not in the stack
    shared = make_checkpoint(tmp_path / "shared", cfg)
    llm = engine(shared)
    assert llm.engine.runner.decode_stack is None
    assert len(llm.generate(["the cache"], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3
