"""Client mode against a tiny fake OpenAI-compatible server on 127.0.0.1 (in-process)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deepinfer.bench.client import ClientConfig, parse_usage, run_workload
from deepinfer.bench.report import write_report
from deepinfer.bench.traces import TraceRequest
from deepinfer.bench.sessions import Session, Turn, Workload
from deepinfer.bench.workloads import workload_from_trace

FIRST_TOKEN_DELAY = 0.03


class FakeServer:
    """Streams ``reply-<n>`` in 3 chunks; usage in the style named by the model field."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.sent_usage: list[dict] = []
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    n = len(fake.bodies)
                    fake.bodies.append({"path": self.path, "auth": self.headers.get(
                        "Authorization"), **body})
                    fake.active += 1
                    fake.max_active = max(fake.max_active, fake.active)
                try:
                    fake.respond(self, body, n)
                finally:
                    with fake.lock:
                        fake.active -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def respond(self, h: BaseHTTPRequestHandler, body: dict, n: int) -> None:
        style = body["model"]
        if style == "fail":
            h.send_response(500)
            h.end_headers()
            h.wfile.write(b'{"error": "nope"}')
            return
        if "messages" in body:
            prompt_tokens = len(json.dumps(body["messages"])) // 4
        else:
            prompt_tokens = len(body["prompt"])
        cached = prompt_tokens // 2 + n
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()

        def send(obj):
            h.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            h.wfile.flush()

        time.sleep(FIRST_TOKEN_DELAY)
        chat = "messages" in body
        for piece in (f"reply-{n}", " more", " end"):
            ch = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            send({"id": "x", "choices": [ch]})
            time.sleep(0.005)
        usage: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                       "total_tokens": prompt_tokens + 3}
        extra: dict = {}
        if style == "openai":
            usage["prompt_tokens_details"] = {
                "cached_tokens": cached,
                "cached_tokens_by_tier": {"device": cached - 1, "host": 1}}
        elif style == "deepseek":
            usage["prompt_cache_hit_tokens"] = cached
            usage["prompt_cache_miss_tokens"] = prompt_tokens - cached
        elif style == "llamacpp":
            usage = {}
            extra["timings"] = {"cache_n": cached, "prompt_n": prompt_tokens - cached,
                                "predicted_n": 3}
        with self.lock:
            self.sent_usage.append({"n": n, "prompt": prompt_tokens, "cached": cached})
        send({"id": "x", "choices": [], **({"usage": usage} if usage else {}), **extra})
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()


@pytest.fixture()
def server():
    s = FakeServer()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _chat_workload(users=2, turns=3):
    sessions = []
    for u in range(users):
        ts = [Turn(new_messages=[{"role": "user", "content": f"u{u}-t{k} " + "x" * 200}],
                   max_tokens=3, request_id=f"u{u}-t{k}") for k in range(turns)]
        sessions.append(Session(session_id=f"u{u}", turns=ts))
    return Workload(name="unit-chat", sessions=sessions)


def _cfg(server, style, **kw):
    return ClientConfig(base_url=server.url, model=style, progress=False,
                        request_timeout_s=10.0, **kw)


@pytest.mark.parametrize("style", ["openai", "deepseek", "llamacpp"])
def test_chat_multi_turn_ttft_and_cached(server, style):
    t0 = time.perf_counter()
    recs = run_workload(_cfg(server, style, concurrency=2, api_key="k"), _chat_workload())
    wall = time.perf_counter() - t0
    assert len(recs) == 6 and all(r.ok for r in recs)
    sent = {u["n"]: u for u in server.sent_usage}
    for r in recs:  # seconds, within the run (the server sleeps before its first token)
        assert FIRST_TOKEN_DELAY * 0.8 <= r.ttft_s < r.e2e_s <= wall
        assert r.tpot_s is not None and r.tpot_s > 0
        assert r.completion_tokens == 3 and r.cached_reported
    by_body = {}
    for n, b in enumerate(server.bodies):
        by_body[b["messages"][-1]["content"].split()[0]] = sent[n]
    for r in recs:
        exp = by_body[r.request_id]
        assert (r.prompt_tokens, r.cached_tokens) == (exp["prompt"], exp["cached"])
        if style == "openai":
            assert r.cached_by_tier == {"device": exp["cached"] - 1, "host": 1}
    # turn k+1 carries turn k's reply (sent only after it arrived); history grows
    for b in server.bodies:
        msgs = b["messages"]
        k = int(msgs[-1]["content"].split()[0].split("-t")[1])
        assert len(msgs) == 2 * k + 1
        for j in range(k):
            assert msgs[2 * j + 1]["role"] == "assistant"
            assert msgs[2 * j + 1]["content"].startswith("reply-")
            assert msgs[2 * j + 1]["content"].endswith(" more end")
    b0 = server.bodies[0]
    assert b0["path"] == "/v1/chat/completions" and b0["auth"] == "Bearer k"
    assert b0["stream"] is True and b0["stream_options"] == {"include_usage": True}


def test_concurrency_and_request_bounds(server):
    wl = _chat_workload(users=6, turns=2)
    recs = run_workload(_cfg(server, "openai", concurrency=2), wl)
    assert len(recs) == 12 and server.max_active <= 2
    server.bodies.clear()
    recs = run_workload(_cfg(server, "openai", concurrency=3, max_requests=4), wl)
    assert len(recs) == 4 and len(server.bodies) == 4


def test_duration_bound(server):
    wl = _chat_workload(users=1, turns=50)
    recs = run_workload(_cfg(server, "openai", max_duration_s=0.5), wl)
    # the run stops at the bound instead of playing all 50 turns (each takes over 0.03 s: the
    # server sleeps that long before its first token)
    assert len(recs) < 50 and all(r.ok for r in recs)


def test_trace_replay_token_prompts(server, tmp_path):
    reqs = [TraceRequest(0.0, "a", [1, 2], 4, 8, 3, namespace="n", request_id="0"),
            TraceRequest(0.05, "a", [1, 2, 3], 4, 12, 3, namespace="n", request_id="1"),
            TraceRequest(0.0, None, [7], 4, 4, 3, namespace="n", request_id="2")]
    wl = workload_from_trace(reqs, vocab_size=1000, low=5)
    recs = run_workload(_cfg(server, "openai"), wl)
    assert len(recs) == 3 and all(r.ok for r in recs)
    assert all(b["path"] == "/v1/completions" for b in server.bodies)
    prompts = sorted((b["prompt"] for b in server.bodies), key=len)
    assert [len(p) for p in prompts] == [4, 8, 12] and prompts[2][:8] == prompts[1]
    by_id = {r.request_id: r for r in recs}
    assert by_id["1"].arrival_s >= 0.05 and by_id["1"].arrival_s >= by_id["0"].finish_s
    assert by_id["1"].ideal_cached_tokens == 8 and by_id["1"].prompt_tokens == 12
    doc = write_report(tmp_path / "run", {"fake": recs}, plots=False)
    assert doc["configs"]["fake"]["ideal_hit_rate"] == pytest.approx(8 / 24)
    assert doc["configs"]["fake"]["cached_tokens"] == sum(r.cached_tokens for r in recs)
    assert (tmp_path / "run" / "summary.md").exists()


def test_http_error_becomes_record_and_stops_session(server):
    recs = run_workload(_cfg(server, "fail"), _chat_workload(users=1, turns=3))
    assert len(recs) == 1 and not recs[0].ok and "HTTP 500" in recs[0].error


def test_parse_usage_variants():
    u = parse_usage({"prompt_tokens": 10, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 4}})
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (10, 4, 2)
    assert parse_usage({"prompt_tokens": 10, "prompt_cache_hit_tokens": 6}).cached_tokens == 6
    u = parse_usage(None, {"cache_n": 7, "prompt_n": 3, "predicted_n": 5})
    assert (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (10, 7, 5)
    u = parse_usage({"prompt_tokens": 10, "prompt_tokens_details": None})
    assert u.cached_tokens is None
    assert ClientConfig("http://127.0.0.1:1/v1/", "m").api_base == "http://127.0.0.1:1/v1"
    assert ClientConfig("http://127.0.0.1:1", "m").api_base == "http://127.0.0.1:1/v1"


def test_cli_client_and_ideal(server, tmp_path, capsys):
    from deepinfer.bench.cli import main

    args = ["client", "--endpoint", f"a={server.url}", "--endpoint", f"b={server.url}/v1",
            "--model", "openai", "--workload", "chat", "--workload-args",
            '{"num_users": 2, "turns": 2, "system_tokens": 50, "user_tokens": 10}',
            "--out", str(tmp_path), "--run", "r", "--no-progress", "--concurrency", "2"]
    assert main(args) == 0
    doc = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert list(doc["configs"]) == ["a", "b"]
    assert all(s["num_requests"] == 4 and s["hit_rate"] > 0 for s in doc["configs"].values())
    assert "| metric | a | b |" in capsys.readouterr().out

    trace = tmp_path / "t_blk4.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}\n'
        '{"timestamp": 5, "input_length": 6, "output_length": 1, "hash_ids": [1, 3]}\n')
    assert main(["ideal", str(trace), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ideal_hit_tokens"] == 4 and row["input_tokens"] == 14


def test_engine_bench_peers_get_the_tool_format_of_the_engine_columns(server, tiny_llama, tmp_path):
    """With ``--tool-format text`` the engine columns render tool calls as text; a peer endpoint in
    the same report must get the very same messages (OpenAI tool messages would differ, and some
    servers reject them)."""
    from deepinfer.bench.cli import main

    args = ["engine", "--model", str(tiny_llama), "--workload", "agent", "--workload-args",
            '{"num_agents": 1, "steps": 2, "num_tools": 1, "task_tokens": 4, '
            '"tool_output_tokens": 8, "tool_output_growth": 4, "max_tokens": 2}',
            "--tool-format", "text", "--configs", "l1", "--baseline", "none",
            "--engine-args", '{"page_size": 4, "num_pages": 1024, "max_model_len": 2048}',
            "--endpoint", f"peer={server.url}",
            "--endpoint-model", "openai", "--out", str(tmp_path), "--run", "r", "--no-progress"]
    assert main(args) == 0
    sent = [m for b in server.bodies for m in b["messages"]]
    assert len(server.bodies) == 2 and any(m["role"] == "assistant" for m in sent)
    assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
               and "tool_calls" not in m for m in sent)
