"""One bad request fails alone: the others finish with the very tokens they get without it.

Each poison below once crashed a whole engine step (and with it every request decoding at the
time). Validation now stops them at ``add_request``; these tests switch validation off to show
that, should such a value get through anyway, only its own request fails. With overlap
scheduling too (a step that raises on the worker thread is rolled back and run plainly)."""

import pytest
import torch

from deepinfer import engine as engine_module
from deepinfer.errors import RequestError
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

OTHERS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)


def prompts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(n)]


def make(tiny_llama, **kw):
    args = dict(page_size=4, num_pages=256, max_num_batched_tokens=256, progress=False,
                enable_disk_cache=False)
    args.update(kw)
    return LLM(str(tiny_llama), **args).engine


def run(engine, poison=None):
    """Three greedy streams and a seeded one decode; ``poison(engine)`` comes in mid-way."""
    ps = prompts(4, 13, seed=5)
    reqs = [engine.add_request(p, OTHERS) for p in ps[:3]]
    reqs.append(engine.add_request(ps[3], SEEDED))
    for _ in range(3):
        engine.step()
    bad = poison(engine) if poison else None
    outs = engine.run_to_completion(reqs)
    return [o.token_ids for o in outs], bad


def unchecked(monkeypatch):
    """Let values through that validation would stop (a value that slips past it)."""
    monkeypatch.setattr(SamplingParams, "validate", lambda self: None)
    monkeypatch.setattr(engine_module, "check_text", lambda field, s, nonempty=False: s)
    monkeypatch.setattr(engine_module.LLMEngine, "validate_prompt", lambda self, ids: None)


def assert_clean(engine):
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    kv = engine.kv
    cached = kv.tree.evictable_pages(0) if kv.tree is not None else 0
    assert kv.num_free_pages + cached == engine.runner.pool.allocator.num_pages - 1


SAMPLING_POISONS = [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1e-45),
                    dict(top_p=1e-300), dict(top_k=2**63), dict(seed=2**64),
                    dict(seed=-(2**70))]
# (prompt, extra params) whose failure comes elsewhere: post-processing (a stop string check
# that raises), the forward pass (ids the embedding cannot index, an id no tensor holds)
OTHER_POISONS = {"stop check": ([5, 6, 7, 8, 9], dict(stop=[123])),
                 "forward": ([5, 10**6, 7], {}), "negative id": ([5, -1, 7], {}),
                 "int64 overflow": ([5, 2**63, 7], {})}


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return run(make(tiny_llama))[0]


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])


@OVERLAP
@pytest.mark.parametrize("bad_params", SAMPLING_POISONS, ids=lambda d: f"{d}")
def test_sampling_poison_fails_alone(tiny_llama, expected, monkeypatch, bad_params, overlap):
    eng = make(tiny_llama, overlap_schedule=overlap)
    unchecked(monkeypatch)

    def poison(e):
        p = SamplingParams(max_tokens=5)
        for k, v in bad_params.items():
            setattr(p, k, v)
        return e.add_request([9, 8, 7, 6, 5, 4], p)

    got, bad = run(eng, poison)
    assert got == expected
    assert bad.finish_reason == "error" and bad.error
    assert eng.make_output(bad).error == bad.error
    assert eng.stats()["failed_requests_total"] == 1
    assert_clean(eng)


@OVERLAP
@pytest.mark.parametrize("case", list(OTHER_POISONS))
def test_step_and_postprocessing_poison_fails_alone(tiny_llama, expected, monkeypatch, case, overlap):
    eng = make(tiny_llama, overlap_schedule=overlap)
    unchecked(monkeypatch)
    prompt, extra = OTHER_POISONS[case]
    got, bad = run(eng, lambda e: e.add_request(prompt, SamplingParams(max_tokens=5, **extra)))
    assert got == expected
    assert bad.finish_reason == "error" and bad.error
    assert_clean(eng)


@OVERLAP
@pytest.mark.parametrize("host_gb", [0.0, 0.01], ids=["L1 only", "with L2"])
def test_unencodable_salt_fails_alone(tiny_llama, expected, monkeypatch, host_gb, overlap):
    """The salt that bricked the server: hashing it raised in every later step."""
    eng = make(tiny_llama, host_cache_gb=host_gb, overlap_schedule=overlap)
    unchecked(monkeypatch)
    failed = []

    def poison(e):
        try:
            failed.append(e.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3),
                                        cache_salt="\ud800"))
        except UnicodeEncodeError:  # found while queueing (the L2 lookup hashes at once)
            failed.append(None)

    got, _ = run(eng, poison)
    assert got == expected and len(failed) == 1
    if failed[0] is not None:
        assert failed[0].finish_reason == "error"
    assert_clean(eng)
    # and the engine keeps serving
    assert len(eng.run_to_completion([eng.add_request([3, 4, 5], OTHERS)])[0].token_ids) == 10


BAD_INPUT = [
    (dict(temperature=1e-300), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=1e-300), "top_p"), (dict(top_k=2**63), "top_k"), (dict(seed=2**64), "seed"),
    (dict(seed=-(2**70)), "seed"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop=["\ud800"]), "stop"), (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kw,field", BAD_INPUT, ids=[f for _, f in BAD_INPUT])
def test_offline_api_rejects_what_a_step_cannot_use(kw, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_add_request_rejects_unusable_prompts_salts_and_stop_ids(tiny_llama):
    eng = make(tiny_llama)
    vocab = eng.hf_config.vocab_size
    cases = [(dict(prompt="hi \ud800"), "prompt"), (dict(prompt=[1, 2**63]), "prompt"),
             (dict(prompt=[1, -1]), "prompt"), (dict(prompt=[1, True]), "prompt"),
             (dict(prompt=[1, 2], cache_salt="\udfff"), "cache_salt"),
             (dict(prompt=[1, 2], cache_salt=5), "cache_salt"),
             (dict(prompt=[1, 2], params=SamplingParams(stop_token_ids=[vocab])),
              "stop_token_ids")]
    for kw, field in cases:
        params = kw.pop("params", OTHERS)
        with pytest.raises(RequestError) as e:
            eng.add_request(kw.pop("prompt"), params, **kw)
        assert e.value.field == field, kw
    assert_clean(eng)
    assert SamplingParams(temperature=1e-3).temperature == 1e-3  # the documented minimum
    assert SamplingParams(seed=-(2**63)).seed == -(2**63) and SamplingParams(seed=2**64 - 1)
