"""The kv policy over workers sharing one KV pool, without processes: pages a peer wrote to the
pool (its L3 events) are hits on every peer at ``pool_weight`` each, pages a peer holds or
computes but has not written cost ``duplicate_weight`` more, or a wait for them in the pool
(``Choice.awaits``) where that costs less, a conversation another worker can
load from the pool is not held by stickiness, and without a shared pool the cost is the plain
one (exact expected workers and costs)."""

from __future__ import annotations

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.router.conversations import Conversations
from deepinfer.router.index import PrefixIndex
from deepinfer.router.policy import CostWeights, Policy, pool_peers
from deepinfer.router.prompts import RoutedPrompt
from deepinfer.router.workers import Routed, Worker
from deepinfer.server.kv_events import pool_id
from deepinfer.server.protocol import parse_request

PS = 4
ROOT = root_hash("model-x")
SYSTEM = list(range(40))  # 10 pages shared by every request
NO_EVICT = CostWeights(evict_weight=0.0)
POOL = pool_id("redis://127.0.0.1:6379")


def _prompt(tokens: list[int]) -> RoutedPrompt:
    return RoutedPrompt(parse_request({"prompt": tokens, "max_tokens": 4}, "completion"), tokens)


def _worker(url: str, pool: str | None = POOL) -> Worker:
    return Worker(url, "both", healthy=True, synced=True, model_identity="model-x", page_size=PS,
                  pool_id=pool)


def _request(user: int) -> RoutedPrompt:
    """The system prompt + 2 pages of its own (+1 token): 13 prompt pages, 12 hashed."""
    return _prompt(SYSTEM + list(range(1000 * user, 1000 * user + 9)))


def _sys_hex() -> list[str]:
    return [h.hex() for h in chain_hashes(SYSTEM, PS, ROOT)]


def test_pool_id_tells_shared_pools_apart_without_the_address():
    assert pool_id(None) is None
    url = "redis://:secret@10.0.0.1:6379"
    assert pool_id(url) == pool_id(url) != pool_id("redis://:secret@10.0.0.2:6379")
    assert "secret" not in pool_id(url)
    a, b, c, d = _worker("a"), _worker("b"), _worker("c", pool_id(url)), _worker("d", None)
    assert pool_peers([a, b, c, d]) == {"a": ["b"], "b": ["a"], "c": [], "d": []}


def test_index_pooled_and_coming_pages_of_peers():
    idx = PrefixIndex()
    h = chain_hashes(SYSTEM, PS, ROOT)
    idx.reset("a", {"device": [x.hex() for x in h[:6]], "disk": [x.hex() for x in h[:4]]})
    idx.add_pending("a", h[:8])  # 6 held, 2 more pending
    assert idx.pooled(["a"], h, 0) == 4  # only what a wrote to the pool (its L3)
    assert idx.pooled(["a"], h, 2) == 2 and idx.pooled([], h, 0) == 0
    assert idx.coming(["a"], h, 4) == 4  # held on device (2) then pending (2)
    assert idx.coming(["a"], h, 8) == 0
    idx.apply("a", [{"type": "stored", "tier": "disk", "hashes": [x.hex() for x in h[4:8]]}])
    assert idx.pooled(["a"], h, 0) == 8


def test_a_new_shared_prefix_is_computed_once_with_a_pool():
    """a computes the system prompt (routed there, nothing written yet) and b decodes one
    request. Waiting on b for a's copy in the pool (13 pages of wait and compute + 1.0 for
    loading 10 + 1 decoding: 15) beats a (3 pages + a's 13 open: 16) and computing it again on
    b (13 + 10 duplicated + 1): b, awaiting those 10 pages. Without waits the request gathers on
    a (16 < 24); without a shared pool the cost is Dynamo's and b computes them (14 < 16)."""
    for pool, waits, expect, costs, awaits in ((POOL, True, "b", {"a": 16.0, "b": 15.0}, 10),
                                               (POOL, False, "a", {"a": 16.0, "b": 24.0}, 0),
                                               (None, True, "b", {"a": 16.0, "b": 14.0}, 0)):
        idx = PrefixIndex()
        a, b = _worker("a", pool), _worker("b", pool)
        kv = Policy("kv", idx, NO_EVICT, pool_waits=waits)
        first = kv.pick([a, b], _request(1))
        assert first.worker is a  # a tie, in turn
        idx.add_pending("a", _request(1).page_hashes("model-x", PS))
        a.begin(Routed(pages=14, prefill_pages=13))
        _decoding(b)
        c = kv.pick([a, b], _request(2))
        assert (c.worker.url, c.costs, c.overlap.pooled, c.awaits) == (expect, costs, 0, awaits)
        assert c.awaited_pages == awaits  # the pool must hold the first 10 pages before it goes


def _decoding(w: Worker) -> None:
    """One open request on ``w``, past its first token (1 page-equivalent of load)."""
    r = Routed(pages=5, prefill_pages=4)
    w.begin(r)
    w.first_token(r)


def test_four_requests_sharing_a_new_prefix_at_once():
    """Four requests sharing a new system prompt at once on idle workers. By default the
    second waits on b for a's copy in the pool (13 + 1.0 < a's 3 + 13), and the next ones
    spread in turn (3 + 13 open on either), b's following the pages awaited there: a, b, a, b
    with the prompt computed once. With ``idle_duplicate_weight`` 0 b's copy delays no other request and costs
    less than the wait (13 < 14): the same spread, each worker computing the prompt. Without
    waits, the duplicate term gathers all four on a, where the prompt is computed (b: 13 + 10
    against 16, 19, 22), and with one request decoding on b even at idle weight 0 (b: 13 + 10
    + 1)."""
    spread = CostWeights(evict_weight=0.0, idle_duplicate_weight=0.0)

    def placed(b_busy: bool, weights: CostWeights = NO_EVICT, waits: bool = True
               ) -> list[tuple[str, int]]:
        idx = PrefixIndex()
        a, b = _worker("a"), _worker("b")
        if b_busy:
            _decoding(b)
        kv = Policy("kv", idx, weights, pool_waits=waits)
        out = []
        for user in range(4):
            p = _request(user)
            c = kv.pick([a, b], p)
            c.worker.begin(Routed(p.pages(PS), p.prompt_pages(PS) - c.overlap.pages))
            idx.add_pending(c.worker.url, p.page_hashes("model-x", PS))
            out.append((c.worker.url, c.awaits))
        return out

    assert placed(b_busy=False) == [("a", 0), ("b", 10), ("a", 0), ("b", 0)]
    assert placed(b_busy=False, weights=spread) == [("a", 0), ("b", 0), ("a", 0), ("b", 0)]
    assert placed(b_busy=False, waits=False) == [("a", 0)] * 4
    assert placed(b_busy=True, weights=spread, waits=False) == [("a", 0)] * 4


def test_pages_in_the_pool_are_hits_on_every_peer():
    """a wrote the system prompt to the pool and is busy: b loads it from there (10 pooled
    pages at 0.1, predicted as hits, 3 to prefill) instead of computing it."""
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    idx.reset("a", {"device": _sys_hex(), "disk": _sys_hex()})
    idx.reset("b", {})
    a.begin(Routed(pages=14, prefill_pages=6))
    kv = Policy("kv", idx, NO_EVICT)
    c = kv.pick([a, b], _request(3))
    assert (c.worker.url, c.costs) == ("b", {"a": 9.0, "b": 4.0})
    assert (c.overlap.pages, c.overlap.pooled, c.predicted_hit_tokens) == (0, 10, 40)
    # a worker with its own pool (another id) sees none of it: it would compute all 13
    lone = _worker("c", pool_id("redis://elsewhere:6379"))
    idx.reset("c", {})
    c = kv.pick([a, lone], _request(3))
    assert (c.worker.url, c.costs) == ("a", {"a": 9.0, "c": 13.0})


def test_stickiness_does_not_hold_a_conversation_the_pool_serves_elsewhere():
    """Turn 1 (13 pages) went to a, which wrote all its pages to the pool; turn 2 adds 2 pages.
    a is busy (8 pages queued): b loads turn 1's 12 pages from the pool (1.2) and computes 3
    (4.2 < a's 3 + 8 = 11), so the turn moves; without a pool, stickiness keeps it on a."""
    turn1 = SYSTEM + list(range(1000, 1009))
    turn2 = _prompt(turn1 + list(range(2000, 2008)))
    held = [h.hex() for h in chain_hashes(turn1[:48], PS, ROOT)]
    for pool, expect, sticky in ((POOL, "b", False), (None, "a", True)):
        idx = PrefixIndex()
        a, b = _worker("a", pool), _worker("b", pool)
        idx.reset("a", {"device": held, "disk": held if pool else []})
        idx.reset("b", {})
        conv = Conversations()
        conv.record(_prompt(turn1).page_hashes("model-x", PS), "a")
        a.begin(Routed(pages=10, prefill_pages=8))
        c = Policy("kv", idx, NO_EVICT, conv).pick([a, b], turn2)
        assert (c.worker.url, c.sticky) == (expect, sticky)
        if pool:
            assert c.costs == {"a": 11.0, "b": 4.2} and c.overlap.pooled == 12


def test_the_routers_options_reach_its_cost_weights():
    from deepinfer.router.app import Router
    from deepinfer.router.config import RouterConfig

    router = Router(RouterConfig(workers=["http://127.0.0.1:1"], pool_weight=0.3,
                                 idle_duplicate_weight=1.0, stick_gap=-1.0), tokenizer=None)
    try:
        assert router.policy.weights == CostWeights(pool_weight=0.3, idle_duplicate_weight=1.0,
                                                    stick_gap=-1.0)
    finally:
        router.tokens.close()
