"""Speculative decoding through the engine: greedy with speculation == without, token for token,
on Llama, sliding-window (Gemma 2/3 rings) and MLA (DeepSeek-V3) models, in mixed batches, with
prefix hits, after preemption; the radix tree never caches a rejected token."""

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.kv.radix import Node
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.profile import context_bucket
from deepinfer.spec.verify_schedule import SpsProfile
from tiny_checkpoints import make_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny model makers
import test_deepseek  # noqa: E402
import test_sliding_window  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPECS = {
    "ngram-k3": SpeculativeConfig(method="ngram", num_tokens=3, scheduled=False),
    "suffix-k5": SpeculativeConfig(method="suffix", num_tokens=5, scheduled=False),
    "auto-k5": SpeculativeConfig(method="auto", num_tokens=5, scheduled=False),
    # a fixed profile where a verified token costs 2% of a step: the scheduler verifies some
    "scheduled": SpeculativeConfig(method="ngram", num_tokens=5, scheduled=True,
                                   sps_tokens=(1, 64), sps_steps_per_s=(100.0, 100.0 / 2.26)),
}


def prompts(n, length, seed=0):
    """Random token runs with a repeated stretch, so prompt lookup has something to find."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        head = torch.randint(3, 300, (length,), generator=g).tolist()
        out.append(head + head[: length // 2])
    return out


def make(path, spec=None, **kw):
    """An engine on one thread (tiny models: more threads only add sync overhead)."""
    args = dict(page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False, threads=1,
                enable_disk_cache=False, dtype="float32", device="cpu", speculative_config=spec)
    args.update(kw)
    return LLM(str(path), **args)


def tree_paths(tree):
    """Token sequence from the root to every node of the radix tree."""
    out, stack = [], [(tree.root, [])]
    while stack:
        node, toks = stack.pop()
        for child in node.children.values():
            seq = toks + list(child.tokens)
            out.append(seq)
            stack.append((child, seq))
    return out


def assert_tree_holds_only_real_tokens(llm, sequences):
    for path in tree_paths(llm.engine.kv.tree):
        assert any(s[: len(path)] == path for s in sequences), "a cached page holds a non-emitted token"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    makers = {
        "llama": lambda: __import__("tiny_checkpoints").tiny_llama_config(),
        "gemma2": lambda: test_sliding_window.tiny_gemma2().config,
        "gemma3": lambda: test_sliding_window.tiny_gemma3().config,
        "deepseek_v3": lambda: test_deepseek.tiny_v3(24, test_deepseek.YARN).config,
    }
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), mk()) for name, mk in makers.items()}


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "deepseek_v3"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_with_speculation_equals_without(models, arch, spec):
    ps = prompts(3, 14, seed=1)
    ref = make(models[arch]).generate(ps, GREEDY)
    llm = make(models[arch], SPECS[spec])
    for turn in range(2):  # the second pass hits the prefix cache (and teaches the suffix index)
        outs = llm.generate(ps, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        if turn:
            assert all(o.num_cached_tokens > 0 for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert accepted > 0  # speculation really ran and kept tokens
    assert all(o.num_accepted_tokens <= o.num_verified_tokens <= o.num_drafted_tokens for o in outs)
    assert_tree_holds_only_real_tokens(llm, [p + r.token_ids for p, r in zip(ps, ref)])
    stats = llm.engine.stats()
    method = SPECS[spec].method
    by_source = stats["spec_accepted_tokens_total"]  # auto: counted by the source that drafted
    assert set(by_source) == ({"ngram", "suffix"} if method == "auto" else {method})
    assert sum(by_source.values()) >= accepted


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_greedy_with_speculation_equals_without(models, arch):
    """A verify span's rows run through the decode kernel's span variant: the same bits
    as plain decoding, so bf16 greedy output is the same with speculation on, token for token."""
    ps = prompts(3, 14, seed=4)
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ref = make(models[arch], dtype="bfloat16").generate(ps, long)
    outs = make(models[arch], SPECS["ngram-k3"], dtype="bfloat16").generate(ps, long)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_multi_turn_hits_the_window_and_pages_of_a_speculated_turn(models, arch):
    first = prompts(1, 14, seed=2)[0]
    ref, llm = make(models[arch]), make(models[arch], SPECS["ngram-k3"])
    a, b = ref.generate(first, GREEDY)[0], llm.generate(first, GREEDY)[0]
    assert a.token_ids == b.token_ids
    second = first + a.token_ids + first[:9]
    a2, b2 = ref.generate(second, GREEDY)[0], llm.generate(second, GREEDY)[0]
    assert a2.token_ids == b2.token_ids
    assert b2.num_cached_tokens == a2.num_cached_tokens > len(first)


def test_mixed_batch_of_speculative_and_plain_requests(models):
    ps = prompts(4, 14, seed=3)
    with_logprobs = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    ref = make(models["llama"])
    llm = make(models["llama"], SPECS["ngram-k3"])
    eng, ref_eng = llm.engine, ref.engine
    for e in (eng, ref_eng):  # speculative greedy, plain (logprobs), sampled, penalized
        reqs = [e.add_request(ps[0], GREEDY), e.add_request(ps[1], with_logprobs),
                e.add_request(ps[2], GREEDY),
                e.add_request(ps[3], SamplingParams(max_tokens=40, temperature=1.0, seed=7)),
                e.add_request(ps[0], penalized)]
        e.outs = e.run_to_completion(reqs)
    for i in (0, 1, 2, 4):
        assert eng.outs[i].token_ids == ref_eng.outs[i].token_ids
    # logprobs and penalties read more than the logits: not speculated
    assert eng.outs[1].num_drafted_tokens == eng.outs[4].num_drafted_tokens == 0
    assert eng.outs[1].logprobs == pytest.approx(ref_eng.outs[1].logprobs, abs=1e-5)
    assert eng.outs[0].num_accepted_tokens > 0
    assert len(eng.outs[3].token_ids) == 40


def test_preempted_speculative_requests_give_identical_output(models):
    ps = prompts(6, 20, seed=8)
    ref = make(models["llama"], enable_prefix_cache=False).generate(ps, GREEDY)
    tight = make(models["llama"], SPECS["ngram-k3"], num_pages=40, max_model_len=120)
    outs = tight.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert tight.engine.kv.stats.preemptions > 0
    assert sum(o.num_accepted_tokens for o in outs) > 0


def test_stop_conditions_inside_an_accepted_draft(models):
    p = prompts(1, 14, seed=4)[0]
    ref = make(models["llama"]).generate(p, GREEDY)[0].token_ids
    llm = make(models["llama"], SPECS["ngram-k3"])
    for n in (1, 7, 13):
        out = llm.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    stop = ref[9]
    out = llm.generate(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"


def test_scheduled_mode_profiles_sps_at_the_running_context(models):
    llm = make(models["llama"], SpeculativeConfig(method="ngram", num_tokens=3, scheduled=True))
    free = llm.engine.kv.num_free_pages
    assert free == llm.engine.runner.pool.allocator.num_pages - 1
    assert llm.engine.spec.sps.profiles == {}  # nothing measured before a request decodes
    ps = prompts(2, 14, seed=5)
    ref = make(models["llama"]).generate(ps, GREEDY)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == [r.token_ids for r in ref]
    (bucket, sps), = llm.engine.spec.sps.profiles.items()  # 21-61 tokens: one context bucket
    assert bucket == context_bucket(61) and sps.tokens == [1, 2, 3, 4] and all(s > 0 for s in sps.seconds)
    before = sps.observed
    steps: list[int] = []  # the token count of each step the lone request below runs
    observe = llm.engine.spec.sps.observe
    llm.engine.spec.sps.observe = lambda req, b, seconds: (steps.append(b), observe(req, b, seconds))
    one = llm.generate(ps[0], GREEDY)[0]
    assert one.token_ids == ref[0].token_ids
    # every step is priced into the profile, at a point of its own (a verify span of up to 4
    # tokens: 4 is interpolated from the measured 1-3 until steps run it); the prompt ran
    # before, so its first step is a 1-token one too (all of it but its last token is cached)
    assert len(steps) == len(one.token_ids) - one.num_accepted_tokens
    assert sum(b - 1 for b in steps) == one.num_verified_tokens and set(steps) <= set(sps.tokens)
    assert sps.observed == before + len(steps)
    # every page not free is held by the tree: no page of a rejected draft or the profile leaked
    assert llm.engine.kv.num_free_pages == free - sum(len(n.tiers[0] or []) for n in _nodes(llm.engine.kv.tree))


def test_scheduled_mode_verifies_nothing_when_a_span_costs_a_step_per_token(models):
    costly = SpeculativeConfig(method="ngram", num_tokens=5, scheduled=True,
                               sps_tokens=(1, 8), sps_steps_per_s=(100.0, 100.0 / 8))
    ps = prompts(2, 14, seed=7)
    llm = make(models["llama"], costly)  # one request at a time: no prefill chunk shares a step
    outs = [llm.generate(p, GREEDY)[0] for p in ps]
    assert sum(o.num_drafted_tokens for o in outs) > 0
    assert sum(o.num_verified_tokens for o in outs) == 0
    assert llm.engine.spec.sps.fixed.observed == 0  # a given profile stays as given
    ref = make(models["llama"]).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def _nodes(tree) -> list[Node]:
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out += list(n.children.values())
        stack += n.children.values()
    return out


def test_cli_flags_reach_the_engine_and_the_summary_line(models, capsys):
    from deepinfer.cli import main as cli_main

    text = "one two three four five six seven eight " * 3
    args = ["generate", text, "--model", str(models["llama"]), "--page-size", "4",
            "--num-pages", "256", "--max-tokens", "24", "--host-cache-gb", "0", "--no-disk-cache",
            "--threads", "1",
            "--speculative-method", "ngram", "--speculative-num-tokens", "4"]
    assert cli_main(args) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "; speculative: " in line and " drafted, " in line and " accepted (" in line
    assert cli_main(args[:-1] + ["0"]) == 2  # k must be >= 1: a clear error
    assert "speculative num_tokens must be >= 1" in capsys.readouterr().err


def test_prefix_hits_from_disk_with_speculation(models, tmp_path):
    """A fresh engine on the same L3 directory hits the pages a speculative run cached: those
    pages hold only emitted tokens, so the output is the one without speculation."""
    ps = prompts(2, 14, seed=6)
    ref = make(models["llama"]).generate(ps, GREEDY)
    disk = dict(enable_disk_cache=True, disk_cache_dir=str(tmp_path), host_cache_gb=0)
    first = make(models["llama"], SPECS["ngram-k3"], **disk)
    assert [o.token_ids for o in first.generate(ps, GREEDY)] == [r.token_ids for r in ref]
    first.engine.shutdown()
    again = make(models["llama"], SPECS["ngram-k3"], **disk)
    longer = [p + r.token_ids for p, r in zip(ps, ref)]
    outs = again.generate(longer, GREEDY)
    assert all(o.cached_tokens_by_tier.get("disk", 0) > 0 for o in outs)
    plain = make(models["llama"]).generate(longer, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]


def test_scheduled_steps_without_any_draft_run_as_speculative_steps(models, caplog):
    """The shared suffix index is empty until a request ends: the first request's steps have
    no draft at all, which must not make the speculative step fail (and fall back to plain)."""
    llm = make(models["llama"], SpeculativeConfig(method="suffix", num_tokens=3, scheduled=True))
    p = prompts(1, 14, seed=8)[0]
    with caplog.at_level("WARNING", logger="deepinfer.engine"):
        first = llm.generate(p, GREEDY)[0]
        again = llm.generate(p, GREEDY)[0]  # now the index knows the first reply
    assert "speculative step failed" not in caplog.text
    assert first.num_drafted_tokens == 0 and again.num_drafted_tokens > 0
    assert again.token_ids == first.token_ids == make(models["llama"]).generate(p, GREEDY)[0].token_ids
