"""The draft-model source: greedy outputs equal speculation off with a separate tiny draft, the
target as its own draft (every token accepted) and its int4 copy (some rejected); its KV rolls
back with the target's; no page leaks in either pool; rejection sampling with a real draft's
q keeps the target distribution; an incompatible draft is a clear start-up error."""

import pytest
import torch

from deepinfer.layers.sampler import filtered_probs
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.draft_model import DraftModel
from deepinfer.spec.verify import verify
from test_spec_engine import GREEDY, _nodes, make, prompts
from tiny_checkpoints import make_checkpoint, make_tokenizer, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    small = tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return {"target": make_checkpoint(mk("target"), tiny_llama_config()),
            "small": make_checkpoint(mk("small"), small, seed=1)}


def draft_spec(path, k=4, **kw):
    return SpeculativeConfig(method="draft_model", model=str(path), num_tokens=k, scheduled=False, **kw)


def assert_no_leaks(llm):
    """After every request ended: the draft pool is all free, the target's holds only the
    pages its radix tree caches."""
    source = llm.engine.spec.source
    assert not source.shadows
    assert source.allocator.num_free == source.allocator.num_pages - 1
    kv = llm.engine.kv
    tree_pages = sum(len(n.tiers[0] or []) for n in _nodes(kv.tree))
    assert kv.num_free_pages == llm.engine.runner.pool.allocator.num_pages - 1 - tree_pages


SHORT = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("draft", ["small", "self", "self-int4"])
def test_greedy_with_a_draft_model_equals_speculation_off(ckpts, draft):
    ps = prompts(3, 14, seed=11)
    ref = make(ckpts["target"]).generate(ps, SHORT)
    path = ckpts["small" if draft == "small" else "target"]
    spec = draft_spec(path, draft_quantization="int4" if draft == "self-int4" else None)
    llm = make(ckpts["target"], spec, host_cache_gb=0)
    for _ in range(2):  # the second pass hits the target's prefix cache; the draft recomputes
        outs = llm.generate(ps, SHORT)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    verified = sum(o.num_verified_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert verified > 0
    if draft == "self":  # the target drafting for itself: every draft token survives
        assert accepted == verified
    if draft == "self-int4":  # a close draft: some kept, some rejected (and rolled back)
        assert 0 < accepted < verified
    assert llm.engine.stats()["spec_accepted_tokens_total"]["draft_model"] >= accepted
    assert_no_leaks(llm)


def test_draft_kv_rolls_back_to_what_the_target_kept(ckpts):
    """After a rejection (and after a full acceptance) the incremental draft proposes exactly
    what a draft computing the whole context from scratch proposes."""
    llm = make(ckpts["target"], draft_spec(ckpts["target"], draft_quantization="int4"))
    source = llm.engine.spec.source
    req = Request("r", prompts(1, 14, seed=12)[0], GREEDY)

    def fresh(r):
        other = DraftModel(source.runner, source.target)  # same weights and pool, no shadows
        d = other.propose_batch([(r, 4)])[0]
        other.finished(r)
        return d

    first = source.propose_batch([(req, 4)])[0]
    assert len(first.tokens) == 4 and first.probs is None  # greedy: point masses
    req.output_token_ids += first.tokens[:1] + [(first.tokens[1] + 1) % 300]  # second rejected
    after_reject = source.propose_batch([(req, 4)])[0]
    assert source.shadows[req].num_computed_tokens == req.num_tokens + 3
    req.output_token_ids += after_reject.tokens + [7]  # all accepted, then a bonus token
    after_accept = source.propose_batch([(req, 3)])[0]
    ref = fresh(req)
    assert after_accept.tokens == ref.tokens[:3] and after_accept.features == ref.features[:3]
    req.output_token_ids = req.output_token_ids[:2]
    assert fresh(req).tokens == after_reject.tokens
    source.finished(req)
    assert source.allocator.num_free == source.allocator.num_pages - 1


def test_aborted_requests_and_a_full_draft_pool(ckpts):
    """A draft pool too small for every request drafts for fewer (output unchanged); an aborted
    request's draft pages come back on the next step."""
    ps = prompts(3, 14, seed=13)
    ref = make(ckpts["target"]).generate(ps, SHORT)
    llm = make(ckpts["target"], draft_spec(ckpts["target"], draft_num_pages=14))  # 52 tokens
    assert [o.token_ids for o in llm.generate(ps, SHORT)] == [r.token_ids for r in ref]
    assert_no_leaks(llm)
    eng = llm.engine
    reqs = [eng.add_request(p, SHORT) for p in ps]
    while not eng.spec.source.shadows:
        eng.step()
    eng.abort(reqs[0].request_id)
    eng.run_to_completion(reqs[1:])
    assert_no_leaks(llm)


CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("draft", ["small", "self-int4"])
def test_rejection_sampling_with_a_real_draft_q_keeps_the_target_distribution(ckpts, draft):
    """x ~ q from a draft model's logits (the small one: mostly rejected; the int4 copy of the
    target: mostly kept), verified against the target's: the emitted token follows the
    target's filtered distribution (chi-square, seeded)."""
    prompt = prompts(1, 10, seed=14)[0]
    p_logits = make(ckpts["target"]).engine.score([prompt])[0][0][-1:]
    drafter = (make(ckpts["small"]) if draft == "small" else
               make(ckpts["target"], quantization="int4"))
    q_logits = drafter.engine.score([prompt])[0][0][-1:]
    params = SamplingParams(temperature=1.5, top_k=5)
    p = filtered_probs(p_logits, [params])[0]
    # the identity holds for any q the draft token is drawn from; unfiltered, the small
    # draft's q overlaps the target's top 5 (its own top 5 need not)
    q = filtered_probs(q_logits, [params if draft != "small" else SamplingParams(temperature=1.5)])
    assert not torch.allclose(p, q[0], atol=1e-3)
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([p_logits, p_logits])  # row 1 (the bonus token's) is unused on rejection
    counts = torch.zeros_like(p)
    n, kept = 2000, 0
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        out = verify(logits, [x], params, g, q)
        counts[out[0]] += 1
        kept += len(out) == 2
    assert 0 < kept < n
    support = p > 0
    assert counts[~support].sum() == 0 and int(support.sum()) == 5
    expected = p[support] * n
    assert float(((counts[support] - expected) ** 2 / expected).sum()) < CHI2_DF4_P001


def test_sampled_requests_with_a_draft_model(ckpts):
    """Sampled requests draft by sampling from q, which verification uses: with the target
    drafting for itself q == p, so every draft token is kept (with q taken as a point mass,
    a token would be kept only with probability p(x))."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    ps = prompts(2, 14, seed=15)
    llm = make(ckpts["target"], draft_spec(ckpts["target"]))
    a = llm.generate(ps, params)
    assert all(len(o.token_ids) == 24 for o in a)
    assert sum(o.num_accepted_tokens for o in a) == sum(o.num_verified_tokens for o in a) > 0
    assert_no_leaks(llm)


def test_an_incompatible_draft_is_a_clear_start_up_error(ckpts, tmp_path):
    bigger = make_checkpoint(tmp_path / "bigger", tiny_llama_config(vocab_size=400))
    with pytest.raises(ValueError, match="vocabulary of 400 tokens"):
        make(ckpts["target"], draft_spec(bigger))
    other_tok = make_checkpoint(tmp_path / "other", tiny_llama_config())
    make_tokenizer(corpus=["completely different words make other merges " * 3]).save_pretrained(other_tok)
    with pytest.raises(ValueError, match="does not share the tokenizer"):
        make(ckpts["target"], draft_spec(other_tok))
    with pytest.raises(ValueError, match="needs a draft model path"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="needs method draft_model"):
        SpeculativeConfig(method="ngram", model=str(bigger))


def test_cli_draft_model_flag(ckpts, capsys):
    from deepinfer.cli import main as cli_main

    args = ["generate", "one two three four five six", "--model", str(ckpts["target"]),
            "--page-size", "4", "--num-pages", "128", "--max-tokens", "12", "--host-cache-gb", "0",
            "--no-disk-cache", "--threads", "1", "--speculative-draft-model", str(ckpts["target"])]
    assert cli_main(args) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "; speculative: " in line and " accepted (" in line
    assert cli_main(args + ["--speculative-method", "suffix"]) == 2
    assert "needs method draft_model" in capsys.readouterr().err
