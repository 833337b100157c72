"""The KV event pieces without processes: the radix tree's listener, the bounded event log and
its reset rule, the router's prefix index, and the kv policy's cost."""

from __future__ import annotations

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.kv.radix import DEVICE, DISK, HOST, RadixTree
from deepinfer.router.index import PrefixIndex
from deepinfer.router.policy import Policy
from deepinfer.router.prompts import RoutedPrompt
from deepinfer.router.workers import Worker
from deepinfer.server.kv_events import KVEventLog, attach_event_log
from deepinfer.server.protocol import parse_request

PS = 4
ROOT = root_hash("model-x")


def _tree_with_log(max_events: int = 1000) -> tuple[RadixTree, KVEventLog]:
    tree = RadixTree(PS, max_node_pages=2)
    log = attach_event_log(tree, max_events)
    assert log is not None
    return tree, log


def _replay(log: KVEventLog) -> set[tuple[bytes, int]]:
    held: set[tuple[bytes, int]] = set()
    for e in log.since(0)[0]:
        pairs = {(h, e.tier) for h in e.hashes}
        held = held | pairs if e.stored else held - pairs
    return held


def test_events_replay_to_what_the_tree_holds():
    tree, log = _tree_with_log()
    a = chain_hashes(list(range(24)), PS, ROOT)
    b = chain_hashes(list(range(12)) + [99] * 12, PS, ROOT)  # shares 3 pages with a
    tree.insert(a, None, DEVICE, list(range(6)))
    tree.insert(b, None, DEVICE, list(range(10, 16)))
    m = tree.match(a)
    tree.add_tier(m.path[-1], HOST, ["slot"] * m.path[-1].num_pages)  # a copy to L2
    assert _replay(log) == set(tree.held_pages())
    freed = []
    tree.evict(DEVICE, 4, lambda node, tier: freed.append(node))
    assert freed and _replay(log) == set(tree.held_pages())
    assert (m.path[-1].hashes[0], HOST) in _replay(log)
    # the rest: a's L2 tail goes with its prefix (removed events of a dropped subtree)
    tree.evict(DEVICE, 100, lambda node, tier: None)
    assert tree.held_pages() == [] and _replay(log) == set()


def test_a_subscriber_that_fell_behind_gets_reset():
    log = KVEventLog(max_events=3)
    for i in range(5):
        log.stored([bytes([i]) * 16], DEVICE)
    assert log.seq == 5
    events, reset = log.since(3)
    assert [e.seq for e in events] == [4, 5] and not reset
    events, reset = log.since(2)
    assert [e.seq for e in events] == [3, 4, 5] and not reset
    assert log.since(1) == ([], True)  # event 2 is gone
    assert log.since(9) == ([], True)  # ahead of this log: a restarted worker
    assert log.since(5) == ([], False)


def test_no_log_without_prefix_cache_or_buffer():
    assert attach_event_log(None, 10) is None
    tree = RadixTree(PS)
    assert attach_event_log(tree, 0) is None and tree.listener is None


def _events(stored: bool, tier: str, hashes: list[bytes]) -> dict:
    return {"type": "stored" if stored else "removed", "tier": tier,
            "hashes": [h.hex() for h in hashes]}


def test_index_counts_leading_pages_by_tier():
    idx = PrefixIndex()
    h = chain_hashes(list(range(40)), PS, ROOT)  # 10 pages
    idx.reset("w", {"device": [x.hex() for x in h[:3]], "host": [x.hex() for x in h[:6]],
                    "disk": []})
    o = idx.overlap("w", h)
    assert o.pages == 6 and o.by_tier == {"device": 3, "host": 3, "disk": 0}
    idx.apply("w", [_events(False, "host", h[:6]), _events(True, "disk", h[3:8])])
    o = idx.overlap("w", h)
    assert o.pages == 8 and o.by_tier == {"device": 3, "host": 0, "disk": 5}
    idx.apply("w", [_events(False, "device", h[1:2])])  # a hole: nothing after it counts
    assert idx.overlap("w", h).pages == 1
    idx.drop("w")
    assert idx.overlap("w", h).pages == 0 and idx.num_pages("w") == 0


def _prompt(tokens: list[int]) -> RoutedPrompt:
    return RoutedPrompt(parse_request({"prompt": tokens, "max_tokens": 4}, "completion"), tokens)


def _worker(url: str) -> Worker:
    return Worker(url, "both", healthy=True, synced=True, model_identity="model-x", page_size=PS)


def test_kv_cost_weighs_prefill_against_load():
    idx = PrefixIndex()
    tokens = list(range(81))  # 20 full pages before the last token
    hashes = chain_hashes(tokens[:80], PS, ROOT)
    idx.reset("a", {"device": [h.hex() for h in hashes[:16]]})
    a, b = _worker("a"), _worker("b")
    kv = Policy("kv", idx)
    p = _prompt(tokens)
    c = kv.pick([a, b], p)
    assert c.worker is a and c.predicted_hit_tokens == 16 * PS
    a.prefill_pages = 15  # 21 - 16 + 15 = 20 < 21: still a
    assert kv.pick([a, b], p).worker is a
    a.prefill_pages = 17  # 22 > 21: b, which computes it all but is idle
    assert kv.pick([a, b], p).worker is b
    assert Policy("least_load", idx).pick([a, b], p).worker is b
    rr = Policy("round_robin", idx)
    assert [rr.pick([a, b], p).worker.url for _ in range(4)] == ["a", "b", "a", "b"]
    cold = _prompt([7] * 9)  # no overlap anywhere, equal load: in turn
    a.prefill_pages = 0
    assert {kv.pick([a, b], cold).worker.url for _ in range(2)} == {"a", "b"}


def test_an_l3_stored_event_waits_until_its_writes_land():
    """The tree records L3 when a write is queued; a pool peer can load the page only once it
    is there, so the log publishes L3 "stored" when ``writing`` says the write landed (other
    tiers at once), and an L3 removal before then drops it."""
    queued = {b"\x01" * 8, b"\x02" * 8}
    log = KVEventLog(writing=lambda hashes: any(h in queued for h in hashes))
    log.stored([b"\x01" * 8], DISK)
    log.stored([b"\x02" * 8], DISK)
    log.stored([b"\x03" * 8], DEVICE)
    events, _ = log.since(0)
    assert [(e.tier, e.hashes) for e in events] == [(DEVICE, (b"\x03" * 8,))]
    log.removed([b"\x02" * 8], DISK)  # evicted from the pool before its write landed
    queued.clear()
    events, _ = log.since(1)
    assert [(e.stored, e.tier, e.hashes) for e in events] == [
        (False, DISK, (b"\x02" * 8,)), (True, DISK, (b"\x01" * 8,))]
    assert log.since(log.seq) == ([], False)
