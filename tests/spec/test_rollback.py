"""KV rollback after a verify span (``KVCacheManager.rollback``): the pages only rejected
tokens' KV took go back to the page pool at once, the radix tree never holds a rejected token,
and the pool's accounting stays exact."""

from deepinfer.kv.cache_manager import KVCacheManager
from deepinfer.kv.pool import PageAllocator
from deepinfer.kv.radix import DEVICE
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.config import SpeculativeConfig

PS = 4


def _running(kv: KVCacheManager, prompt: list[int]) -> Request:
    """A request whose prompt is computed and cached, its last token about to decode."""
    req = Request("r", prompt, SamplingParams(max_tokens=64, temperature=0.0))
    kv.match_prefix(req)
    assert kv.allocate(req, len(prompt))
    req.num_computed_tokens = len(prompt) - 1  # (the last token's KV comes with its decode)
    kv.cache_pages(req)
    return req


def test_rollback_frees_rejected_pages_and_keeps_the_tree_exact():
    kv = KVCacheManager(PageAllocator(32), PS, "model-id", max_node_pages=64)
    total = kv.num_free_pages
    req = _running(kv, list(range(10, 20)))  # 10 tokens: 9 computed, 3 pages
    assert len(req.pages) == 3 and req.num_tree_pages == 2
    assert kv.allocate(req, 1 + 8)  # a verify span: the last token and 8 draft tokens
    assert len(req.pages) == 5  # KV for up to 18 tokens
    # two draft tokens accepted: the last token and both are computed, the rest rejected
    req.output_token_ids += [20, 21, 22]  # accepted, accepted, the bonus token
    req.num_computed_tokens += 3
    kv.cache_pages(req)
    assert kv.rollback(req) == 2  # 12 computed tokens need 3 pages
    assert len(req.pages) == 3 and req.num_tree_pages == 3
    assert kv.num_free_pages == total - 3
    # the tree holds the computed tokens' full pages and nothing past them
    m = kv.tree.match(req.page_hashes, touch=False, count_hit=False)
    assert m.num_pages == 3 and list(m.last.tokens)[-PS:] == [18, 19, 20, 21]
    assert kv.rollback(req) == 0  # nothing more to give back
    kv.release(req)
    assert kv.num_free_pages + kv.tree.pages_in_tier[DEVICE] == total  # every page accounted for


def test_rollback_keeps_the_pages_of_the_steps_own_tokens():
    kv = KVCacheManager(PageAllocator(16), PS, "model-id", max_node_pages=64)
    total = kv.num_free_pages
    req = _running(kv, list(range(30, 38)))  # 8 tokens: 7 computed, 2 pages
    assert kv.allocate(req, 9) and len(req.pages) == 4
    assert kv.rollback(req, 1) == 2  # back to this step's one decode token: 8 tokens, 2 pages
    assert len(req.pages) == 2 and kv.num_free_pages == total - 2
    req.num_computed_tokens += 1  # the decode ran
    kv.cache_pages(req)
    assert kv.rollback(req) == 0 and req.num_tree_pages == 2  # a tree page stays the tree's


def test_speculating_engine_holds_exactly_its_tokens_pages_after_every_step(tiny_llama):
    """Scheduled speculation with a measured SPS profile (whose dummy spans take pages too) and
    fixed-k speculation: after every step each running request holds the pages of its computed
    tokens and no more, and the pool gets every page back when the requests end."""
    prompt = list(range(40, 60)) * 2  # a repeated run: prompt lookup drafts from the start
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for spec in (SpeculativeConfig(method="ngram", num_tokens=4),
                 SpeculativeConfig(method="ngram", num_tokens=4, scheduled=False)):
        llm = LLM(str(tiny_llama), page_size=PS, num_pages=64, progress=False, threads=1,
                  enable_disk_cache=False, dtype="float32", speculative_config=spec)
        engine = llm.engine
        free = engine.kv.num_free_pages
        reqs = [engine.add_request(prompt, params), engine.add_request(prompt[5:], params)]
        while engine.has_unfinished():
            engine.step()
            for r in engine.scheduler.running:
                assert len(r.pages) == -(-r.num_computed_tokens // PS)
        assert all(len(r.output_token_ids) == 30 for r in reqs)
        assert engine.kv.num_free_pages + engine.kv.tree.pages_in_tier[DEVICE] == free
        if spec.scheduled:  # (what its plan verifies depends on the machine's speed)
            assert engine.spec.sps.profiles  # measured on a running request
        else:
            assert all(0 < r.spec.accepted < r.spec.verified for r in reqs)
        engine.shutdown()
