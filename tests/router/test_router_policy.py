"""The kv policy's inputs without processes: pending pages in the prefix index (added on
route, confirmed or cleared by events, expiring), the load the router tracks per worker, and
the choices the cost makes from them (exact expected workers)."""

from __future__ import annotations

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.router.index import PrefixIndex
from deepinfer.router.policy import CostWeights, Policy, kv_cost
from deepinfer.router.prompts import RoutedPrompt
from deepinfer.router.proxy import StreamSniffer, cached_tokens
from deepinfer.router.workers import Load, Routed, Worker
from deepinfer.server.protocol import parse_request

PS = 4
ROOT = root_hash("model-x")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hex(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def _prompt(tokens: list[int]) -> RoutedPrompt:
    return RoutedPrompt(parse_request({"prompt": tokens, "max_tokens": 4}, "completion"), tokens)


def _worker(url: str) -> Worker:
    return Worker(url, "both", healthy=True, synced=True, model_identity="model-x", page_size=PS)


def test_pending_pages_count_until_an_event_or_the_ttl():
    clock = Clock()
    idx = PrefixIndex(pending_ttl_s=10.0, clock=clock)
    h = chain_hashes(list(range(40)), PS, ROOT)  # 10 pages
    idx.reset("w", {"device": _hex(h[:2])})
    idx.add_pending("w", h[:6])  # the 2 held stay held; 4 more pending
    o = idx.overlap("w", h)
    assert (o.pages, o.pending, o.by_tier["device"]) == (6, 4, 2)
    assert idx.num_pending("w") == 4
    # stored confirms (held now, no longer pending); removed evicts a pending page
    idx.apply("w", [{"type": "stored", "tier": "device", "hashes": _hex(h[2:4])},
                    {"type": "removed", "tier": "device", "hashes": _hex(h[4:5])}])
    o = idx.overlap("w", h)
    assert (o.pages, o.pending) == (4, 0) and idx.num_pending("w") == 1  # h[5], after a hole
    idx.add_pending("w", h[4:8])
    clock.now += 9.0
    assert idx.overlap("w", h).pages == 8
    clock.now += 1.0  # the TTL passed without an event
    assert idx.overlap("w", h).pages == 4 and idx.num_pending("w") == 0
    idx.add_pending("w", h[4:8])
    idx.forget_pending("w", h[6:8])  # the request failed
    assert idx.overlap("w", h).pages == 6
    idx.reset("w", {"device": []})  # a snapshot replaces everything, pending included
    assert idx.overlap("w", h).pages == 0
    idx.add_pending("w", h)
    idx.drop("w")  # the worker left rotation
    assert idx.overlap("w", h).pages == 0 and idx.num_pending("w") == 0


def test_load_moves_from_prefill_to_decode_and_back_to_zero():
    w = _worker("w")
    r1, r2 = Routed(pages=10, prefill_pages=8), Routed(pages=5, prefill_pages=3)
    w.begin(r1)
    w.begin(r2)
    assert w.load == Load(prefill_pages=11, decoding=0, active_pages=15)
    w.first_token(r1)
    w.first_token(r1)  # once only
    assert w.load == Load(prefill_pages=3, decoding=1, active_pages=15)
    w.end(r1)
    w.end(r2)  # ended before its first token (an error, a client that left)
    assert w.load == Load() and w.in_flight == 0


def test_cost_counts_the_work_ahead_of_the_first_token():
    weights = CostWeights(overlap_weight=2.0, decode_weight=0.5)
    assert kv_cost(3, Load(prefill_pages=10, decoding=4), weights) == (2 * 3 + 10 + 2, 12)
    assert kv_cost(0, Load(), weights) == (0, 0)


def test_concurrent_requests_sharing_a_new_prefix_are_co_located():
    """Two requests with one new 16-page prefix and 1-page tails, both workers idle and
    empty: the first goes to a (in turn); its pages are pending there, so the second costs 1
    page there (+ a's 17 queued) against 17 on b: weight 2 puts it on a (2 + 17 < 34), weight
    1 on the idle b (1 + 17 > 17)."""
    shared = list(range(64))
    p1, p2 = _prompt(shared + [1, 2, 3]), _prompt(shared + [5, 6, 7])

    def second_after_first(weight: float) -> tuple[str, str, int]:
        idx = PrefixIndex()
        a, b = _worker("a"), _worker("b")
        kv = Policy("kv", idx, CostWeights(overlap_weight=weight))
        first = kv.pick([a, b], p1)
        first.worker.begin(Routed(p1.pages(PS), p1.prompt_pages(PS)))
        idx.add_pending(first.worker.url, p1.page_hashes("model-x", PS))
        second = kv.pick([a, b], p2)
        return first.worker.url, second.worker.url, second.pending_hit_tokens

    assert second_after_first(2.0) == ("a", "a", 16 * PS)
    assert second_after_first(1.0) == ("a", "b", 0)


def test_disjoint_prefixes_spread_by_load():
    """Cold requests with nothing shared: each goes where less prefill is queued; requests
    decoding count decode_weight each."""
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    kv = Policy("kv", idx, CostWeights(overlap_weight=2.0, decode_weight=1.0))
    placed = []
    for i in range(4):
        p = _prompt([100 * i + t for t in range(40)])  # 10 pages each
        c = kv.pick([a, b], p)
        c.worker.begin(Routed(p.pages(PS), p.prompt_pages(PS)))
        idx.add_pending(c.worker.url, p.page_hashes("model-x", PS))
        placed.append(c.worker.url)
    assert placed == ["a", "b", "a", "b"]
    # b's requests decode now (2 x 1 page-equivalent) while a still prefills 20 pages: b
    b.prefill_pages, b.decoding = 0, 2
    assert kv.pick([a, b], _prompt(list(range(900, 940)))).worker is b
    # a prefix held on a outweighs a's queue when it saves more than the queue costs
    hot = list(range(900, 980))  # 20 pages
    idx.reset("a", {"device": _hex(chain_hashes(hot, PS, ROOT))})
    a.prefill_pages = 10  # 2 x 1 + 10 = 12 on a vs 2 x 21 + 2 = 44 on b
    assert kv.pick([a, b], _prompt(hot + [1])).worker is a


def test_stream_sniffer_finds_usage_and_the_first_token():
    seen = []
    s = StreamSniffer(2, lambda: seen.append("first"))
    s.feed(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\nda')
    assert seen == []
    s.feed(b'ta: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
    assert seen == ["first"]
    s.feed(b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 8}}}\n\n'
           b'data: [DONE]\n\n')
    assert seen == ["first"] and s.cached_tokens == 8
    # Anthropic's usage: message_start's zero, then message_delta's count
    a = StreamSniffer(2, lambda: None)
    a.feed(b'event: message_start\ndata: {"message": {"usage": {"cache_read_input_tokens": 0}}}'
           b'\n\nevent: message_delta\ndata: {"usage": {"cache_read_input_tokens": 12}}\n\n')
    assert a.cached_tokens == 12
    assert cached_tokens({"cache_read_input_tokens": 3, "input_tokens": 5}) == 3
