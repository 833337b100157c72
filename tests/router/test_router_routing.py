"""The kv router's placement with real workers: pending pages (a turn sent before the
previous turn's KV events reach the router), requests sharing a new prefix kept together,
disjoint ones spread, and Anthropic's ``/v1/messages`` hashed, routed and streamed."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest
from router_helpers import metric, settle, state
from router_procs import PAGE, RouterThread


@pytest.fixture(scope="module")
def kv(tiny_llama, workers):
    # pending pages last the whole module: a request slower than the default TTL (a loaded
    # machine) must not turn the pending-pages prediction below into a coin toss. No eviction
    # term: the session's workers have small pools that earlier test files filled unevenly, and
    # these tests are about overlap, pending pages and load (test_router_policy.py prices
    # eviction exactly)
    r = RouterThread(tiny_llama, [w.url for w in workers], overlap_weight=2.0,
                     pending_ttl_s=3600.0, evict_weight=0.0)
    settle(r.url, [w.url for w in workers])
    yield r
    r.stop()


class HeldEvents:
    """Holds the KV events the router's subscriptions receive (as if they were late) until
    ``release()`` applies them, in order."""

    def __init__(self, router: RouterThread) -> None:
        self.index = router.router.index
        self.apply = self.index.apply
        self.held: list[tuple[str, list[dict]]] = []
        self.lock = threading.Lock()

    def __enter__(self) -> "HeldEvents":
        def hold(worker: str, events) -> None:
            with self.lock:
                self.held.append((worker, list(events)))
        self.index.apply = hold
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            del self.index.apply  # the class's method again
            for worker, events in self.held:
                self.apply(worker, events)


def _chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 4, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def test_next_turn_follows_pending_pages_before_events_arrive(kv, workers):
    urls = [w.url for w in workers]
    messages = [{"role": "system", "content": "You log the tides of a small harbour town, "
                                              "hour by hour, for the fishermen there."},
                {"role": "user", "content": "when is high tide today?"}]
    pending_before = metric(kv.url, "pending_hit_tokens_total")
    with HeldEvents(kv) as held:
        r1 = _chat(kv.url, messages)
        first = r1.headers["x-deepinfer-worker"]
        prompt1 = r1.json()["usage"]["prompt_tokens"]
        messages += [r1.json()["choices"][0]["message"],
                     {"role": "user", "content": "and the low tide after it?"}]
        # no event about turn 1 has reached the index: without its pending pages both
        # workers cost the same and the tie would go to the other worker, in turn
        r2 = _chat(kv.url, messages)
        assert held.held, "the workers emitted events about turn 1"
    assert r2.headers["x-deepinfer-worker"] == first
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt1 - 1) // PAGE * PAGE  # turn 1's prompt pages were there
    pending = metric(kv.url, "pending_hit_tokens_total") - pending_before
    assert pending == (prompt1 - 1) // PAGE * PAGE  # predicted from pending alone
    settle(kv.url, urls)  # the held events landed: they confirm the pages
    assert state(kv.url)[first]["pending_pages"] < state(kv.url)[first]["index_pages"]


def _concurrently(send, n: int) -> list:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(send, range(n)))


def test_requests_sharing_a_new_prefix_go_together(kv, workers):
    system = ("You catalogue the moths of the northern forests by wing pattern, colour and "
              "season, and you answer every question with one moth name only. " * 2)
    before = {u: s["routed"] for u, s in state(kv.url).items()}
    answers = _concurrently(lambda i: _chat(kv.url, [
        {"role": "system", "content": system}, {"role": "user", "content": f"moth {i}?"}]), 2)
    served = {r.headers["x-deepinfer-worker"] for r in answers}
    assert len(served) == 1
    # the second joined the first's prefix there instead of computing it again
    assert max(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
               for r in answers) >= 40
    after = state(kv.url)
    assert sum(after[u]["routed"] - before[u] for u in before) == 2


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_disjoint_prompts_spread_over_the_workers(kv, workers):
    # one after another: no load and no shared page anywhere, so the ties go in turn
    words = ["granite", "velvet", "orchard", "lantern"]
    placed = [_complete(kv.url, f"{w} " * 30).headers["x-deepinfer-worker"] for w in words]
    assert sorted(placed.count(w.url) for w in workers) == [2, 2]
    assert placed[0] != placed[1] and placed[2] != placed[3]
    # at once: a request that finds one worker still busy goes to the other, one that
    # finds both idle takes its turn; either way no worker is left out (the exact split
    # depends on which requests finish before the next is routed)
    words = ["basalt", "linen", "meadow", "beacon"]
    answers = _concurrently(lambda i: _complete(kv.url, f"{words[i]} " * 30), 4)
    placed = {r.headers["x-deepinfer-worker"] for r in answers}
    assert placed == {w.url for w in workers}


def test_anthropic_messages_are_routed_and_streamed(kv, workers):
    urls = [w.url for w in workers]
    body = {"max_tokens": 4, "temperature": 0, "system": "You name rivers of the world, "
            "one per answer, and nothing else at all, ever.",
            "messages": [{"role": "user", "content": "a long river?"}]}
    r1 = httpx.post(kv.url + "/v1/messages", json=body, timeout=120)
    assert r1.status_code == 200 and r1.json()["type"] == "message", r1.text
    worker = r1.headers["x-deepinfer-worker"]
    settle(kv.url, urls)
    body["messages"] += [{"role": "assistant", "content": r1.json()["content"][0]["text"]},
                         {"role": "user", "content": "a short one?"}]
    predicted = state(kv.url)[worker]["predicted_hit_tokens"]
    reported = metric(kv.url, "reported_hit_tokens_total")
    with httpx.stream("POST", kv.url + "/v1/messages", json={**body, "stream": True},
                      timeout=120) as r2:
        assert r2.status_code == 200 and r2.headers["x-deepinfer-worker"] == worker
        text = r2.read().decode()
    assert text.startswith("event: message_start") and "event: message_stop" in text
    usage = [line for line in text.split("\n") if '"message_delta"' in line][0]
    cached = httpx.Response(200, content=usage[len("data: "):]).json()["usage"][
        "cache_read_input_tokens"]
    assert cached > 0
    # the router hashed the conversation as the worker's Anthropic path renders it
    gained = state(kv.url)[worker]["predicted_hit_tokens"] - predicted
    assert 0 < gained <= cached
    assert metric(kv.url, "reported_hit_tokens_total") == reported + cached
    bad = httpx.post(kv.url + "/v1/messages", json={"messages": body["messages"]})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error" and "max_tokens" in bad.json()["error"]["message"]
