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


def test_index_counts_the_pages_each_worker_holds_in_its_device_pool():
    idx = PrefixIndex()
    h = chain_hashes(list(range(40)), PS, ROOT)  # 10 pages
    idx.reset("w", {"device": _hex(h[:4]), "host": _hex(h[2:6])})
    assert (idx.device_pages("w"), idx.num_pages("w")) == (4, 6)
    idx.apply("w", [{"type": "stored", "tier": "device", "hashes": _hex(h[4:8])},  # 2 from L2
                    {"type": "stored", "tier": "device", "hashes": _hex(h[0:1])},  # again: no-op
                    {"type": "removed", "tier": "device", "hashes": _hex(h[0:2])},
                    {"type": "removed", "tier": "host", "hashes": _hex(h[2:4])},  # L1 keeps them
                    {"type": "removed", "tier": "device", "hashes": _hex(h[9:10])}])  # unknown
    assert (idx.device_pages("w"), idx.num_pages("w")) == (6, 6)  # h[2:8]
    idx.drop("w")
    assert idx.device_pages("w") == 0


def test_overflow_is_what_the_new_pages_need_beyond_the_free_ones():
    from deepinfer.router.policy import overflow

    assert [overflow(5, 8), overflow(5, 5), overflow(5, 2), overflow(5, -3)] == [0, 0, 3, 5]
    weights = CostWeights(overlap_weight=1.0, decode_weight=1.0, evict_weight=2.0)
    assert kv_cost(3, Load(prefill_pages=4), weights, evicts=5) == (3 + 2 * 5 + 4, 4)


def _full_worker_and_empty_one(hot: list[int]) -> tuple[PrefixIndex, Worker, Worker]:
    """a: a 20-page pool, full (its 20 pages: ``hot``'s first pages, then others); b: a
    40-page pool, empty."""
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    a.cache_pages, b.cache_pages = 20, 40
    mine = chain_hashes(hot, PS, ROOT)
    others = chain_hashes(list(range(5000, 5000 + 4 * (20 - len(mine)))), PS, ROOT)
    idx.reset("a", {"device": _hex(mine + others)})
    idx.reset("b", {"device": []})
    return idx, a, b


def test_a_full_worker_pays_for_what_the_request_evicts_there():
    """The request: 88 prompt tokens (22 pages; 23 with its 4 max_tokens). a (full) holds its
    first 4 pages: it would prefill 18 and push 19 cached pages out (cost 18 + 19 = 37) where
    b (empty) prefills all 22 (cost 22): b. Without the eviction term a would win (18 < 22)."""
    tokens = list(range(88))
    idx, a, b = _full_worker_and_empty_one(tokens[:16])
    p = _prompt(tokens)
    assert Policy("kv", idx).free_pages(a) == 0 and Policy("kv", idx).free_pages(b) == 40
    assert Policy("kv", idx).pick([a, b], p).worker is b
    assert Policy("kv", idx, CostWeights(evict_weight=0.0)).pick([a, b], p).worker is a
    # a long hit outweighs the eviction: a holds 16 of its pages, prefills 6 and evicts 7
    # (6 + 7 = 13 < 22)
    idx, a, b = _full_worker_and_empty_one(tokens[:64])
    assert Policy("kv", idx).pick([a, b], p).worker is a


def test_pending_pages_take_free_room_until_their_events_arrive():
    """Two cold 10-page requests (11 pages with max_tokens) onto a 12-page worker a and a
    12-page worker b, b busy with a 5-page prefill: the first goes to a (10 < 10 + 5); its 9
    hashed pages pending there leave a 3 free, so the second would evict 8 there (10 + 8 =
    18) and goes to b (10 + 5 = 15). Once a's events say those pages are stored, free room is
    the same 3: still b."""
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    a.cache_pages = b.cache_pages = 12
    idx.reset("a", {"device": []})
    idx.reset("b", {"device": []})
    b.prefill_pages = 5
    kv = Policy("kv", idx)
    p1, p2 = _prompt(list(range(40))), _prompt(list(range(100, 140)))
    assert kv.pick([a, b], p1).worker is a
    idx.add_pending("a", p1.page_hashes("model-x", PS))
    assert kv.free_pages(a) == 12 - 9  # 9 hashed pages (the last token is always computed)
    assert kv.pick([a, b], p2).worker is b
    idx.apply("a", [{"type": "stored", "tier": "device",
                     "hashes": _hex(p1.page_hashes("model-x", PS))}])
    assert kv.free_pages(a) == 3 and kv.pick([a, b], p2).worker is b


def test_a_tie_goes_to_the_worker_holding_more_of_the_prompt():
    """A conversation's turn of 16 pages: a holds its first 12 pages and has 5 queued (cost
    4 + 5 = 9), b holds the 9-page system prompt only and has 2 queued (7 + 2 = 9), as in the
    benchmark's placement log. The same wait; a computes 3 pages fewer: a (the less loaded b
    before)."""
    tokens = list(range(64))
    h = chain_hashes(tokens[:63], PS, ROOT)
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    idx.reset("a", {"device": _hex(h[:12])})
    idx.reset("b", {"device": _hex(h[:9])})
    a.prefill_pages, b.prefill_pages = 5, 2
    c = Policy("kv", idx, CostWeights(evict_weight=0.0)).pick([a, b], _prompt(tokens))
    assert (c.worker.url, c.costs, c.overlap.pages) == ("a", {"a": 9.0, "b": 9.0}, 12)
    b.prefill_pages = 1  # b's cost 8 now: the cost decides, not the tie-break
    assert Policy("kv", idx, CostWeights(evict_weight=0.0)).pick([a, b], _prompt(tokens)
                                                                 ).worker is b
