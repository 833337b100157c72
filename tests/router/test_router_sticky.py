"""Conversation stickiness of the kv policy, without processes: a turn continuing a
conversation stays on the worker its previous turn went to while the load gap is at most
``stick_gap``; a larger gap, evicted private pages, a new conversation sharing only a system
prompt, or the holder out of rotation leave the choice to the cost (exact expected workers)."""

from __future__ import annotations

from deepinfer.kv.hashing import chain_hashes, root_hash
from deepinfer.router.conversations import Conversations
from deepinfer.router.index import PrefixIndex
from deepinfer.router.policy import CostWeights, Policy
from deepinfer.router.prompts import RoutedPrompt
from deepinfer.router.workers import Routed, Worker
from deepinfer.server.protocol import parse_request

PS = 4
ROOT = root_hash("model-x")
SYSTEM = list(range(36))  # 9 pages shared by every conversation
NO_EVICT = CostWeights(evict_weight=0.0, stick_gap=8.0)


def _prompt(tokens: list[int]) -> RoutedPrompt:
    return RoutedPrompt(parse_request({"prompt": tokens, "max_tokens": 4}, "completion"), tokens)


def _worker(url: str) -> Worker:
    return Worker(url, "both", healthy=True, synced=True, model_identity="model-x", page_size=PS)


def _route(kv: Policy, idx: PrefixIndex, workers: list[Worker], p: RoutedPrompt) -> str:
    """As the router does: pick, then the prompt's pages pending there and its tail recorded."""
    c = kv.pick(workers, p)
    hashes = p.page_hashes("model-x", PS)
    idx.add_pending(c.worker.url, hashes)
    kv.conversations.record(hashes, c.worker.url)
    return c.worker.url


def _two_turns() -> tuple[RoutedPrompt, RoutedPrompt]:
    """Turn 1: the system prompt + 3 pages of the user's text; turn 2: turn 1 + 4 pages
    (reply and next message)."""
    turn1 = SYSTEM + list(range(1000, 1013))  # 49 tokens: 12 hashed pages
    return _prompt(turn1), _prompt(turn1 + list(range(2000, 2016)))


def _set_up() -> tuple[PrefixIndex, Policy, Worker, Worker]:
    """a and b both hold the system prompt; the conversation's turn 1 went to a."""
    idx = PrefixIndex()
    a, b = _worker("a"), _worker("b")
    sys_pages = [h.hex() for h in chain_hashes(SYSTEM, PS, ROOT)]
    idx.reset("a", {"device": sys_pages})
    idx.reset("b", {"device": sys_pages})
    kv = Policy("kv", idx, NO_EVICT)
    turn1, _ = _two_turns()
    assert _route(kv, idx, [a, b], turn1) == "a"  # a tie, in turn: a
    return idx, kv, a, b


def test_a_conversations_next_turn_stays_on_its_worker_under_a_small_load_gap():
    """Turn 2 (17 prompt pages): a holds 12 of them and has 8 pages queued (cost 5 + 8 = 13), b
    holds the 9 system pages and is idle (cost 8): the cost says b, the 8-page gap (not over
    ``stick_gap`` 8) keeps it on a."""
    idx, kv, a, b = _set_up()
    _, turn2 = _two_turns()
    a.begin(Routed(pages=10, prefill_pages=8))
    c = kv.pick([a, b], turn2)
    assert (c.worker.url, c.sticky, c.costs, c.overlap.pages) == ("a", True,
                                                                 {"a": 13.0, "b": 8.0}, 12)
    # without stickiness (no tail recorded, or the gap negative: off) the same state goes to b
    assert Policy("kv", idx, NO_EVICT).pick([a, b], turn2).worker is b
    off = Policy("kv", idx, CostWeights(evict_weight=0.0, stick_gap=-1.0), kv.conversations)
    assert off.pick([a, b], turn2).worker is b


def test_a_load_gap_over_stick_gap_hands_the_turn_to_the_cost():
    idx, kv, a, b = _set_up()
    _, turn2 = _two_turns()
    a.begin(Routed(pages=10, prefill_pages=9))  # gap 9 > 8
    c = kv.pick([a, b], turn2)
    assert (c.worker.url, c.sticky) == ("b", False)
    b.begin(Routed(pages=4, prefill_pages=2))  # gap 7 again: back on a
    assert kv.pick([a, b], turn2).worker is a
    # decoding requests count decode_weight pages each in the gap: a 9 + 3, b 2 + 1 -> 9
    a.decoding, b.decoding = 3, 1
    assert kv.pick([a, b], turn2).worker is b


def test_a_new_conversation_sharing_only_the_system_prompt_is_placed_by_cost():
    """Another user's first turn holds the system prompt on both workers and no tail: it goes
    to the idle b, not to a where the other conversation lives."""
    idx, kv, a, b = _set_up()
    a.begin(Routed(pages=10, prefill_pages=3))
    other = _prompt(SYSTEM + list(range(3000, 3013)))
    c = kv.pick([a, b], other)
    assert (c.worker.url, c.sticky) == ("b", False)


def test_evicted_private_pages_end_stickiness():
    """a's events say it evicted the conversation's own pages (the 3 after the system prompt,
    confirmed stored first): a holds no more of turn 2 than b, so the cost decides (b)."""
    idx, kv, a, b = _set_up()
    turn1, turn2 = _two_turns()
    own = [h.hex() for h in turn1.page_hashes("model-x", PS)[9:]]
    idx.apply("a", [{"type": "stored", "tier": "device", "hashes": own},
                    {"type": "removed", "tier": "device", "hashes": own}])
    a.begin(Routed(pages=10, prefill_pages=1))
    assert kv.pick([a, b], turn2).worker is b


def test_a_holder_out_of_rotation_loses_the_conversation_and_does_not_get_it_back():
    """a leaves rotation (not a candidate): turn 2 goes to b, whose tail it records; a back
    in rotation with its index rebuilt still holding turn 1's pages: turn 3 follows turn 2 on
    b (the latest tail), even with a idle and b busy within the gap."""
    idx, kv, a, b = _set_up()
    turn1, turn2 = _two_turns()
    assert _route(kv, idx, [b], turn2) == "b"
    idx.reset("a", {"device": [h.hex() for h in turn1.page_hashes("model-x", PS)]})
    turn3 = _prompt(turn2.token_ids + list(range(4000, 4016)))
    b.begin(Routed(pages=10, prefill_pages=6))
    c = kv.pick([a, b], turn3)
    assert (c.worker.url, c.sticky) == ("b", True)


def test_conversations_find_the_latest_tail_and_stay_bounded():
    h = chain_hashes(list(range(40)), PS, ROOT)  # 10 pages
    conv = Conversations(capacity=2)
    conv.record(h[:4], "a")
    conv.record(h[:7], "b")
    assert conv.holder(h) == "b" and conv.holder(h[:5]) == "a" and conv.holder(h[:3]) is None
    conv.record(h[:9], "a")  # a third tail: the oldest (h[3]) goes
    assert len(conv) == 2 and conv.holder(h[:5]) is None and conv.holder(h) == "a"
    conv.record([], "a")  # a prompt shorter than a page has no tail
    assert len(conv) == 2
