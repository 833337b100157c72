"""Penalties and logit_bias match a plain reference on logits, alone and through the engine."""

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer.layers.logits_processors import apply_logit_bias, apply_penalties
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    """vLLM's semantics, one token at a time: bias; repetition over prompt + output
    (divide a positive logit, multiply a negative one); frequency per count, presence once."""
    x = logits.clone()
    for tok, b in p.logit_bias.items():
        x[tok] += b
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(output).items():
        x[tok] -= p.frequency_penalty * count + p.presence_penalty
    return x


PARAMS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.6),
    SamplingParams(logit_bias={3: 7.5, 9: -100.0}, repetition_penalty=0.6),
    SamplingParams(presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=1.2,
                   logit_bias={0: 1.0}),
]


def test_processors_match_reference_on_random_logits():
    g = torch.Generator().manual_seed(0)
    V = 40
    logits = torch.randn(len(PARAMS) + 1, V, generator=g) * 3
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 1, 12, 5, 3)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (9, 4, 0, 15, 6)]
    rows = [0, 1, 2, 3]  # row 4 asks for nothing and must stay as it is
    got = logits.clone()
    biased = [i for i in rows if PARAMS[i].logit_bias]
    apply_logit_bias(got, biased, [PARAMS[i] for i in biased])
    apply_penalties(got, rows, PARAMS, [prompts[i] for i in rows], [outputs[i] for i in rows])
    for i in rows:
        torch.testing.assert_close(got[i], reference(logits[i], PARAMS[i], prompts[i],
                                                     outputs[i]))
    assert torch.equal(got[4], logits[4])


@pytest.mark.parametrize("params", PARAMS[:2] + PARAMS[3:], ids=["rep", "freq+pres", "all"])
def test_engine_greedy_follows_reference_on_transformers_logits(tiny_llama, params):
    """Every greedy token is the argmax of the reference applied to the HF model's logits of
    the sequence so far; an unpenalised request in the same batch is unaffected."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    llm = LLM(str(tiny_llama), page_size=4, num_pages=256, progress=False,
              enable_disk_cache=False)
    prompt = [5, 17, 17, 42, 99, 5, 230, 17, 64, 8, 8, 8]
    other = [7, 8, 9, 10, 11, 12, 13]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                       presence_penalty=params.presence_penalty,
                       frequency_penalty=params.frequency_penalty,
                       repetition_penalty=params.repetition_penalty,
                       logit_bias=params.logit_bias)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out, side = llm.generate(prompt, p)[0], llm.generate(other, plain)[0]
    mixed = llm.engine.run_to_completion([llm.engine.add_request(prompt, p),
                                          llm.engine.add_request(other, plain)])
    assert mixed[0].token_ids == out.token_ids and mixed[1].token_ids == side.token_ids
    changed = 0  # steps where the penalties changed the argmax (else this proves nothing)
    with torch.no_grad():
        for t, tok in enumerate(out.token_ids):
            ids = prompt + out.token_ids[:t]
            raw = hf(torch.tensor([ids])).logits[0, -1].float()
            assert int(reference(raw, p, prompt, out.token_ids[:t]).argmax()) == tok, t
            changed += int(raw.argmax()) != tok
    assert changed > 0
