"""Speculation on the families and tiers ``test_spec_engine.py`` leaves out (DeepSeek-V2 MLA,
gpt-oss sinks + rings + MoE; prefix hits from L2), and rollback on
pages and rings under a drafter whose every rejection point is known: exact acceptance counts,
output equal to speculation off, no page left behind."""

import sys
from pathlib import Path

import pytest

from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.drafters import Draft, TokenDrafter
from test_spec_engine import _nodes, assert_tree_holds_only_real_tokens, make, prompts
from tiny_checkpoints import make_checkpoint, tiny_llama_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the tiny model makers
import test_deepseek  # noqa: E402
import test_gpt_oss  # noqa: E402
import test_sliding_window  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NGRAM = SpeculativeConfig(method="ngram", num_tokens=3, scheduled=False)
MAKERS = {
    "llama": tiny_llama_config,
    "gemma2": lambda: test_sliding_window.tiny_gemma2().config,
    "deepseek_v2": lambda: test_deepseek.tiny_v2(None, "greedy").config,
    "gpt_oss": lambda: test_gpt_oss.tiny_gpt_oss().config,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), mk()) for name, mk in MAKERS.items()}


def vocab_prompts(n, seed):
    """Prompts within every tiny vocabulary."""
    return [[t % 250 for t in p] for p in prompts(n, 14, seed=seed)]


@pytest.mark.parametrize("arch", ["deepseek_v2", "gpt_oss"])
def test_greedy_with_speculation_equals_without_on_more_families(models, arch):
    ps = vocab_prompts(2, seed=31)
    ref = make(models[arch]).generate(ps, SHORT)
    llm = make(models[arch], NGRAM)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(ps, SHORT)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.num_verified_tokens for o in outs) > 0


def test_prefix_hits_from_host_memory_with_speculation(models):
    ps = vocab_prompts(2, seed=32)
    ref = make(models["llama"]).generate(ps, SHORT)
    llm = make(models["llama"], NGRAM, host_cache_gb=0.01)
    assert [o.token_ids for o in llm.generate(ps, SHORT)] == [r.token_ids for r in ref]
    llm.engine.kv.evict()  # every cached page to L2
    longer = [p + r.token_ids for p, r in zip(ps, ref)]
    outs = llm.generate(longer, SHORT)
    assert all(o.cached_tokens_by_tier.get("host", 0) > 0 for o in outs)
    assert [o.token_ids for o in outs] == [r.token_ids for r in make(models["llama"]).generate(longer, SHORT)]
    assert sum(o.num_verified_tokens for o in outs) > 0


class OracleDrafter(TokenDrafter):
    """Drafts the known greedy continuation with its token at draft position ``wrong`` replaced,
    so verification keeps exactly ``min(wrong, verified)`` tokens and writes KV for the rest."""

    name = "oracle"

    def __init__(self, sequences: list[list[int]], wrong: int) -> None:
        self.sequences, self.wrong = sequences, wrong

    def propose(self, tokens: list[int], k: int) -> Draft:
        seq = next(s for s in self.sequences if s[: len(tokens)] == tokens)
        cont = seq[len(tokens) : len(tokens) + k]
        if self.wrong < len(cont):
            cont[self.wrong] = (cont[self.wrong] + 1) % 250
        return Draft(self.name, cont, [0] * len(cont))


def expected_accepted(max_tokens: int, k: int, wrong: int) -> int:
    """Accepted tokens of one request under the oracle (the first token is the prefill's)."""
    out, accepted = 1, 0
    while out < max_tokens:
        room = min(k, max_tokens - out - 1)
        a = min(wrong, room)
        accepted += a
        out += a + 1
    return accepted


@pytest.mark.parametrize(("arch", "wrong"), [("llama", 0), ("llama", 2), ("gemma2", 0),
                                           ("gemma2", 2), ("gpt_oss", 2)])
def test_rollback_on_pages_and_rings_with_known_rejections(models, arch, wrong):
    k = 4
    ps = vocab_prompts(2, seed=33)
    ref = make(models[arch]).generate(ps, SHORT)
    llm = make(models[arch], SpeculativeConfig(method="ngram", num_tokens=k, scheduled=False))
    llm.engine.spec.source = OracleDrafter([p + r.token_ids for p, r in zip(ps, ref)], wrong)
    outs = llm.generate(ps, SHORT)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    want = expected_accepted(SHORT.max_tokens, k, wrong)
    assert [o.num_accepted_tokens for o in outs] == [want] * len(ps)
    assert all(o.num_verified_tokens > o.num_accepted_tokens for o in outs)  # rejections ran
    kv = llm.engine.kv
    tree_pages = sum(len(n.tiers[0] or []) for n in _nodes(kv.tree))
    assert kv.num_free_pages == llm.engine.runner.pool.allocator.num_pages - 1 - tree_pages
    assert_tree_holds_only_real_tokens(llm, [p + r.token_ids for p, r in zip(ps, ref)])
