"""A request whose sampling fails in a speculative step fails alone: the request beside it,
whose verify span ran in the same forward, keeps exactly the tokens it gets without it. (The
failing row was once the only plain row of the step; sampling re-raised for a single row and
the verify span's tokens were lost after its pages had been counted as computed.)"""

import pytest

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from test_spec_engine import prompts

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KW = dict(page_size=4, num_pages=256, max_num_batched_tokens=256, progress=False,
          enable_disk_cache=False, threads=1, dtype="float32", device="cpu")


def decode_with_poison(engine, prompt, monkeypatch):
    good = engine.add_request(prompt, GREEDY)
    for _ in range(3):
        engine.step()
    monkeypatch.setattr(SamplingParams, "validate", lambda self: None)  # a value slips past
    p = SamplingParams(max_tokens=5)
    p.temperature = 1e-300
    bad = engine.add_request([9, 8, 7, 6, 5, 4], p)
    out = engine.run_to_completion([good])[0]
    while engine.has_unfinished():
        engine.step()
    return out, bad


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_tokens": 3, "scheduled": False},
                                  {"method": "auto"}], ids=["ngram-k3", "auto"])
def test_failed_sampling_beside_a_verify_span_fails_alone(tiny_llama, monkeypatch, spec):
    prompt = prompts(1, 16, seed=3)[0]
    ref = LLM(str(tiny_llama), speculative_config=None, **KW).generate([prompt], GREEDY)[0]
    engine = LLM(str(tiny_llama), speculative_config=spec, **KW).engine
    out, bad = decode_with_poison(engine, prompt, monkeypatch)
    assert out.token_ids == ref.token_ids
    assert out.num_drafted_tokens > 0  # it speculated
    assert bad.finish_reason == "error" and bad.error
    assert engine.stats()["failed_requests_total"] == 1
    assert not engine.requests and not engine.scheduler.running
