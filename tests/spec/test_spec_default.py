"""Speculation is on by default: SpeculativeConfig(), method auto, scheduled (README
"Speculative decoding" has the figures); method none and None are off, and auto steps aside for the features that
cannot run with it; an auto engine's greedy output is the plain one."""

import argparse

import pytest

from deepinfer.cli import add_engine_args, engine_config, speculative_config
from deepinfer.config import EngineConfig
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from test_spec_engine import prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_is_auto_scheduled_and_none_turns_it_off():
    sc = EngineConfig().speculative_config
    assert sc is not None and (sc.method, sc.scheduled, sc.num_tokens) == ("auto", True, 8)
    assert EngineConfig(speculative_config=SpeculativeConfig(method="none")).speculative_config is None
    assert EngineConfig(speculative_config=None).speculative_config is None
    # the default yields to overlap scheduling (not to layer streaming); an explicit method does not
    assert EngineConfig(overlap_schedule=True).speculative_config is None
    assert EngineConfig(kv_stream_layers=True).speculative_config == SpeculativeConfig()
    assert EngineConfig(quantization="int4").speculative_config is None  # did not pay: README
    assert EngineConfig(quantization="int8", speculative_config=SpeculativeConfig()).speculative_config is None
    ngram = SpeculativeConfig(method="ngram")
    assert EngineConfig(overlap_schedule=True, speculative_config=ngram).speculative_config is ngram
    assert EngineConfig(quantization="int4", speculative_config=ngram).speculative_config is ngram


def test_cli_defaults_and_opt_outs():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert speculative_config(p.parse_args([])) == SpeculativeConfig()
    assert speculative_config(p.parse_args(["--speculative-method", "auto"])) == SpeculativeConfig()
    overlap = engine_config(p.parse_args(["--overlap-schedule"]))
    assert overlap.overlap_schedule and overlap.speculative_config is None  # the default yields
    fixed = speculative_config(p.parse_args(["--speculative-method", "ngram", "--no-speculative-scheduled",
                                             "--speculative-num-tokens", "3"]))
    assert (fixed.method, fixed.scheduled, fixed.num_tokens) == ("ngram", False, 3)
    off = EngineConfig(speculative_config=speculative_config(p.parse_args(["--speculative-method", "none"])))
    assert off.speculative_config is None
    draft = speculative_config(p.parse_args(["--speculative-draft-model", "/x"]))
    assert (draft.method, draft.model) == ("draft_model", "/x")


def test_auto_engine_speculates_and_matches_plain_greedy(tiny_llama):
    kw = dict(page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False, threads=1,
              enable_disk_cache=False, dtype="float32", device="cpu")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ps = prompts(2, 14, seed=5)
    plain = LLM(str(tiny_llama), speculative_config={"method": "none"}, **kw)
    default = LLM(str(tiny_llama), **kw)
    assert plain.engine.spec is None and default.engine.spec is not None
    for _ in range(2):  # the second pass also has the suffix index of the first
        ref = [o.token_ids for o in plain.generate(ps, greedy)]
        outs = default.generate(ps, greedy)
        assert [o.token_ids for o in outs] == ref
    # how much is verified depends on the SPS profile measured here; drafting does not
    assert all(o.num_drafted_tokens > 0 for o in outs)
    assert set(default.engine.stats()["spec_drafted_tokens_total"]) == {"ngram", "suffix"}


def test_auto_leaves_sampled_requests_plain(tiny_llama):
    kw = dict(page_size=4, num_pages=512, max_num_batched_tokens=256, progress=False, threads=1,
              enable_disk_cache=False, dtype="float32", device="cpu")
    # nearly greedy, so prompt lookup has drafts for it (see the explicit ngram engine below)
    sampled = SamplingParams(max_tokens=20, temperature=0.05, seed=3, ignore_eos=True)
    ps = prompts(2, 14, seed=6)
    auto = LLM(str(tiny_llama), **kw).generate(ps, sampled)  # the default
    assert all(o.num_drafted_tokens == 0 for o in auto)  # auto: greedy requests only
    plain = LLM(str(tiny_llama), speculative_config={"method": "none"}, **kw).generate(ps, sampled)
    assert [o.token_ids for o in auto] == [o.token_ids for o in plain]  # same seeded draws
    ngram = LLM(str(tiny_llama), speculative_config={"method": "ngram", "scheduled": False}, **kw)
    assert sum(o.num_drafted_tokens for o in ngram.generate(ps, sampled)) > 0  # explicit: drafted
