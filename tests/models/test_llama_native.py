"""The native decode stack (``models/llama_native.py``) end to end: which models and steps take it,
and the bits and tokens it gives (op by op, against the spelled-out ops: test_decode_ops.py)."""

import pytest
import torch
from deepinfer.forward_batch import ForwardBatch, PrefillSegment
from deepinfer.layers.attention import SPAN_AS_DECODES
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from tiny_checkpoints import make_checkpoint, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the cache", "a much longer prompt about the cache and the pages it holds", "pages"]


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), quantization="int4", progress=False, host_cache_gb=0, enable_disk_cache=False, **kwargs)


def test_steps_it_runs_give_the_modules_bits_and_the_eager_tokens(tiny_llama, monkeypatch):
    """Decodes, speculative verify spans and short prefill tails through the stack: each such
    step's hidden states equal the modules' on the same batch, bit for bit, and the tokens equal
    ``--enforce-eager``'s."""
    spec = SpeculativeConfig(method="ngram", scheduled=False, num_tokens=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = PROMPTS + ["pages pages pages pages pages pages"]  # repeats: ngram drafts
    eager = engine(tiny_llama, enforce_eager=True, speculative_config=spec)
    assert eager.engine.runner.decode_stack is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]

    llm = engine(tiny_llama, speculative_config=spec)
    runner = llm.engine.runner
    stack = runner.decode_stack
    assert stack is not None
    ran = []  # (decodes, spans) of each step the stack ran
    forward = stack.forward

    def checked(batch):
        hidden = forward(batch)
        assert torch.equal(hidden, runner.model(batch, runner.kv_buffers))  # (rewrites the same K/V)
        ran.append((batch.num_decodes, len(batch.prefills)))
        return hidden

    monkeypatch.setattr(stack, "forward", checked)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(d > 1 for d, _ in ran)  # decodes batched
    assert any(s for _, s in ran)  # spans (verify spans) too
    # a turn's short tail after a cached prefix: its prefill step is the stack's too
    before = len(ran)
    turn = llm.generate([PROMPTS[1] + " more"], params)[0]
    assert turn.num_cached_tokens and turn.num_computed_tokens <= SPAN_AS_DECODES
    assert ran[before] == (0, 1)


def test_long_prefill_chunks_keep_the_modules(tiny_llama):
    stack = engine(tiny_llama).engine.runner.decode_stack
    segment = PrefillSegment(q_start=0, q_len=SPAN_AS_DECODES + 1, kv_len=SPAN_AS_DECODES + 1,
                             pages=torch.zeros(2, dtype=torch.long))
    batch = ForwardBatch(input_ids=torch.zeros(SPAN_AS_DECODES + 1, dtype=torch.long), positions=None,
                         slot_mapping=None, page_size=16, num_decodes=0, decode_pages=None, decode_kv_lens=None,
                         prefills=[segment], logits_indices=None)
    assert not stack.runs(batch)
    segment.q_len = SPAN_AS_DECODES
    batch.input_ids = batch.input_ids[:SPAN_AS_DECODES]
    assert stack.runs(batch)


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
