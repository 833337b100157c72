"""``deepinfer router`` in front of two real workers: KV-aware placement, round robin, streams
passed through, client disconnects, a worker frozen and thawed, a worker killed."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from router_procs import PAGE, WORKER_PAGES, RouterThread
from deepinfer.cli import main
from deepinfer.router import events
from deepinfer.router.index import PrefixIndex
from deepinfer.router.workers import Worker, WorkerPool
from router_helpers import metric, settle, state

SYSTEMS = ["You are a careful assistant for astronomy questions about distant galaxies.",
           "Reply as a terse ship's captain logging the weather at sea, one line each.",
           "You review Python code and point out every bug you can find in it, politely.",
           "Answer only with questions; never give a straight answer to the user here."]
TURNS = ["first question, please", "a follow-up about that", "and one more thing"]


@pytest.fixture(scope="module")
def kv_router(tiny_llama, workers):
    r = RouterThread(tiny_llama, [w.url for w in workers])
    yield r.url
    r.stop()


@pytest.fixture(scope="module")
def rr_router(tiny_llama, workers):
    r = RouterThread(tiny_llama, [w.url for w in workers], "round_robin")
    yield r.url
    r.stop()


def converse(router_url: str, worker_urls: list[str], system: str) -> list[tuple[str, int, int]]:
    """Three turns; per turn (worker, cached tokens, prompt tokens of the previous turn)."""
    messages = [{"role": "system", "content": system}]
    out, prev_prompt = [], 0
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        r = httpx.post(router_url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((r.headers["x-deepinfer-worker"],
                    body["usage"]["prompt_tokens_details"]["cached_tokens"], prev_prompt))
        prev_prompt = body["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        settle(router_url, worker_urls)
    return out


def test_turns_land_on_the_worker_holding_the_prefix(kv_router, workers):
    urls = [w.url for w in workers]
    settle(kv_router, urls)
    before = metric(kv_router, "reported_hit_tokens_total")
    for system in SYSTEMS[:2]:
        turns = converse(kv_router, urls, system)
        first = turns[0][0]
        for worker, cached, prev_prompt in turns[1:]:
            assert worker == first
            # the whole previous prompt (its full pages) is a hit
            assert cached >= prev_prompt // PAGE * PAGE > 0
    st = state(kv_router)
    assert sum(w["predicted_hit_tokens"] for w in st.values()) > 0
    # predictions come from the same hashes the workers use: never more than they report
    assert all(w["predicted_hit_tokens"] <= w["reported_hit_tokens"] for w in st.values())
    assert metric(kv_router, "reported_hit_tokens_total") > before
    # the free-cache term's inputs: each pool's size from its snapshot, and the device pages
    # the events replayed to, exactly what the worker holds in L1
    settle(kv_router, urls)
    st = state(kv_router)
    for u in urls:
        snap = httpx.get(u + "/kv/snapshot").json()
        assert st[u]["cache_pages"] == snap["cache_pages"] == WORKER_PAGES - 1
        assert st[u]["device_pages"] == len(snap["pages"]["device"])
    assert st[first]["device_pages"] > 0  # (the other worker may have served nothing yet)


def test_round_robin_alternates_and_hits_less(kv_router, rr_router, workers):
    urls = [w.url for w in workers]
    settle(rr_router, urls)
    rr = converse(rr_router, urls, SYSTEMS[2])
    kv = converse(kv_router, urls, SYSTEMS[3])
    rr_workers = [w for w, _, _ in rr]
    assert rr_workers[0] != rr_workers[1] and rr_workers[2] == rr_workers[0]
    assert len({w for w, _, _ in kv}) == 1
    # turn 2 under round robin lands on the worker that never saw the conversation
    assert rr[1][1] < rr[1][2] // PAGE * PAGE <= kv[1][1]
    assert sum(c for _, c, _ in kv) > sum(c for _, c, _ in rr)


def _sse_events(text: str) -> list[dict | str]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_passes_through(kv_router, workers):
    messages = [{"role": "system", "content": SYSTEMS[0]},
                {"role": "user", "content": "stream this answer"}]
    req = {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    reported = metric(kv_router, "reported_hit_tokens_total")
    with httpx.stream("POST", kv_router + "/v1/chat/completions", json=req, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        worker = r.headers["x-deepinfer-worker"]
        events = _sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 6
    streamed = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events[:-2] if e["choices"])
    # the same request straight to the worker that served it: the same reply
    direct = httpx.post(worker + "/v1/chat/completions", timeout=120,
                        json={**req, "stream": False}).json()
    assert streamed == direct["choices"][0]["message"]["content"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert metric(kv_router, "reported_hit_tokens_total") == reported + cached


def test_client_disconnect_aborts_on_the_worker(kv_router, workers):
    aborted = {w.url: metric(w.url, "requests_aborted_total") for w in workers}
    req = {"prompt": "count to a thousand:", "max_tokens": 200, "ignore_eos": True,
           "temperature": 0, "stream": True}
    with httpx.stream("POST", kv_router + "/v1/completions", json=req, timeout=120) as r:
        worker = r.headers["x-deepinfer-worker"]
        next(r.iter_raw())  # the first chunk, then hang up
    _wait_for(lambda: metric(worker, "requests_aborted_total") == aborted[worker] + 1,
              "the worker to abort the request")
    assert state(kv_router)[worker]["in_flight"] == 0


def test_cli_rejects_a_router_without_workers(capsys):
    assert main(["router", "--policy", "kv"]) == 2
    assert "--worker" in capsys.readouterr().err


def test_bad_request_is_answered_by_the_router(kv_router):
    r = httpx.post(kv_router + "/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(kv_router + "/v1/models").json()["data"][0]["id"]


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_unresponsive_worker_leaves_rotation_and_comes_back(kv_router, workers):
    urls = [w.url for w in workers]
    frozen = workers[1]
    frozen.proc.send_signal(signal.SIGSTOP)  # its /health times out
    try:
        _wait_for(lambda: not state(kv_router)[frozen.url]["healthy"], "the health check")
        assert state(kv_router)[frozen.url]["index_pages"] == 0  # the index forgot it
        for i in range(3):
            r = httpx.post(kv_router + "/v1/completions", timeout=120, json={
                "prompt": f"while frozen {i}", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-deepinfer-worker"] == urls[0]
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    _wait_for(lambda: state(kv_router)[frozen.url]["healthy"], "the worker's return")
    settle(kv_router, urls)  # back in rotation, index rebuilt from its snapshot
    assert state(kv_router)[frozen.url]["index_pages"] > 0


def test_killed_worker_leaves_rotation(kv_router, workers):
    urls = [w.url for w in workers]
    dead = workers[1]
    dead.proc.kill()
    dead.proc.wait()
    codes, served = [], set()
    for i in range(6):  # some would have gone to the dead worker: none may fail
        r = httpx.post(kv_router + "/v1/completions", timeout=120, json={
            "prompt": f"request {i} after the crash", "max_tokens": 2, "temperature": 0})
        codes.append(r.status_code)
        served.add(r.headers.get("x-deepinfer-worker"))
    assert codes == [200] * 6 and served == {urls[0]}
    assert not state(kv_router)[dead.url]["healthy"]


def test_event_stream_reset_rebuilds_from_snapshot(kv_router, workers):
    """A subscriber ahead of the worker's log (as after a worker restart) gets ``reset``; the
    index forgets that worker and a snapshot rebuilds it exactly."""
    w = Worker(workers[0].url, "both", healthy=True)
    index = PrefixIndex()
    pool = WorkerPool([w], index, 0.2)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await events.sync(client, pool, w)
            held = index.num_pages(w.url)
            assert held > 0 and w.synced
            w.seq += 1000
            await events.poll(client, pool, w, 0.0)
            assert w.event_resets == 1 and not w.synced and index.num_pages(w.url) == 0
            await events.sync(client, pool, w)
            assert index.num_pages(w.url) == held

    asyncio.run(run())
