"""Hostile-but-fair requests (issue 12): each is a 400/413/415 naming the field, never a 5xx;
the keep-alive connection it came on keeps working; streams decoding meanwhile are unharmed."""

import http.client
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import start_server

from deepinfer.server.api_error import APIError
from deepinfer.server.json_body import parse_json_body
from deepinfer.server.protocol import parse_request

CHAT, COMP, EXPLAIN = "/v1/chat/completions", "/v1/completions", "/v1/cache/explain"
MSGS = [{"role": "user", "content": "Say hi"}]
CHAT_OK = {"messages": MSGS, "max_tokens": 2}


def raw(obj) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate travels as \ud800


def nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


HOSTILE = [
    # (path, body bytes, status, param)
    (CHAT, raw({**CHAT_OK, "cache_salt": "\ud800"}), 400, "cache_salt"),
    (CHAT, raw({**CHAT_OK, "temperature": 1e-300}), 400, "temperature"),
    (CHAT, raw({**CHAT_OK, "temperature": 5e-324}), 400, "temperature"),
    (CHAT, raw({**CHAT_OK, "temperature": 1e-45}), 400, "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400, "top_p"),
    (CHAT, raw({**CHAT_OK, "top_p": 1e-300}), 400, "top_p"),
    (CHAT, raw({**CHAT_OK, "top_k": 2**63}), 400, "top_k"),
    (CHAT, raw({**CHAT_OK, "seed": 2**64}), 400, "seed"),
    (CHAT, raw({**CHAT_OK, "seed": -(2**70)}), 400, "seed"),
    (CHAT, raw({**CHAT_OK, "max_tokens": 10**30}), 400, "max_tokens"),
    (CHAT, raw({**CHAT_OK, "temperature": 10**400}), 400, "temperature"),
    (CHAT, b'{"messages": [], "max_tokens": ' + b"7" * 5000 + b"}", 400, None),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    (CHAT, raw({**CHAT_OK, "x": nested(70)}), 400, "x" + "[0]" * 63),  # depth 65 of the body
    (COMP, raw({"prompt": "hi \ud800", "max_tokens": 2}), 400, "prompt"),
    (CHAT, raw({**CHAT_OK, "model": "\ud800"}), 400, "model"),
    (CHAT, raw({**CHAT_OK, "stop": ["ok", "\udc00"]}), 400, "stop[1]"),
    (CHAT, raw({"messages": [{"role": "user", "content": "a\ud83d"}]}), 400,
     "messages[0].content"),
    (CHAT, raw({"messages": [{"role": "\ud800", "content": "x"}]}), 400, "messages[0].role"),
    (CHAT, raw({"messages": [{"role": "bogus", "content": "x"}]}), 400, "messages[0].role"),
    (CHAT, raw({"messages": [{"role": "r" * 10_000, "content": "x"}]}), 400, "messages[0].role"),
    (CHAT, raw({**CHAT_OK, "stop_token_ids": [10**6]}), 400, "stop_token_ids"),
    (CHAT, raw({**CHAT_OK, "stop_token_ids": [2**64]}), 400, "stop_token_ids"),
    (EXPLAIN, raw({"prompt": [1, 2**63, 3]}), 400, "prompt"),
    (EXPLAIN, raw({"prompt": [1, -4, 3]}), 400, "prompt"),
    (EXPLAIN, raw({"prompt": [1, 10**6, 3]}), 400, "prompt"),
    (EXPLAIN, raw({"prompt": "x", "cache_salt": "\ud800"}), 400, "cache_salt"),
]


def post(conn: http.client.HTTPConnection, path: str, body: bytes,
         ctype: str = "application/json") -> tuple[int, dict]:
    conn.request("POST", path, body=body, headers={"content-type": ctype})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def keep_alive(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(server.host, server.port, timeout=60)


@pytest.mark.parametrize("path,body,status,param", HOSTILE,
                         ids=[f"{i}-{h[3]}" for i, h in enumerate(HOSTILE)])
def test_hostile_request_is_a_4xx_and_the_connection_keeps_working(server, path, body, status,
                                                                    param):
    conn = keep_alive(server)
    try:
        code, out = post(conn, path, body)
        assert code == status, out
        assert out["error"]["param"] == param and out["error"]["type"]
        code, out = post(conn, CHAT, raw(CHAT_OK))  # the same connection
        assert code == 200 and out["usage"]["completion_tokens"] >= 1
    finally:
        conn.close()


def test_wrong_content_type_is_415(server):
    conn = keep_alive(server)
    try:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            code, out = post(conn, CHAT, raw(CHAT_OK), ctype)
            assert code == 415 and out["error"]["code"] == "unsupported_media_type"
        assert post(conn, CHAT, raw(CHAT_OK), "application/json; charset=utf-8")[0] == 200
    finally:
        conn.close()


def test_body_size_is_bounded(tiny_llama):
    srv = start_server(tiny_llama, max_body_bytes=2000)
    try:
        conn = keep_alive(srv)
        big = raw({"messages": [{"role": "user", "content": "x" * 3000}]})
        code, out = post(conn, CHAT, big)
        assert code == 413 and out["error"]["code"] == "request_too_large"
        conn.close()
        conn = keep_alive(srv)
        assert post(conn, CHAT, raw(CHAT_OK))[0] == 200
        conn.close()
    finally:
        srv.stop()


def test_an_internal_error_is_500_and_the_connection_keeps_working(server, monkeypatch):
    def boom(built, salt):
        raise RuntimeError("injected")

    monkeypatch.setattr(server.async_engine.explainer, "explain", boom)
    conn = keep_alive(server)
    try:
        code, out = post(conn, EXPLAIN, raw({"prompt": "hi"}))
        assert code == 500 and out["error"]["type"] == "server_error"
        code, out = post(conn, CHAT, raw(CHAT_OK))
        assert code == 200
    finally:
        conn.close()


def _stream(url: str, prompt: list[int], out: list) -> None:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    toks = []
    with httpx.stream("POST", url + COMP, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                toks.append(json.loads(line[6:])["choices"][0]["text"])
    out.append("".join(toks))


def test_poisons_while_streams_decode_leave_them_unharmed(server):
    prompts = [[5 + i, 17, 33, 2 + i, 90, 41, 7] for i in range(3)]
    alone = []
    for p in prompts:
        _stream(server.url, p, alone)
    got: list = [[] for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(server.url, p, got[i]))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    conn = keep_alive(server)
    try:
        for path, body, status, _ in HOSTILE[:11]:
            assert post(conn, path, body)[0] == status
    finally:
        conn.close()
    for t in threads:
        t.join(120)
    assert [g[0] for g in got] == alone


# ------------------------------------------------------------------ fuzzing
_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | _text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
    max_leaves=12)
_fields = ["messages", "prompt", "model", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "n",
           "logprobs", "top_logprobs", "cache_salt", "stream", "stream_options", "user",
           "presence_penalty", "response_format", "echo", "best_of"]
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])
                                  | _text, "content": _text | _json})
_body = st.fixed_dictionaries(
    {}, optional={**{f: _json for f in _fields},
                  "messages": st.lists(_message, max_size=3) | _json,
                  "prompt": _text | st.lists(st.integers(-5, 2**70), max_size=5) | _json})


@settings(max_examples=150, deadline=None)
@given(body=_body, kind=st.sampled_from(["chat", "completion"]))
def test_fuzz_parser_raises_only_client_errors(body, kind):
    try:
        parse_request(parse_json_body(json.dumps(body).encode()), kind)
    except APIError as e:
        assert 400 <= e.status < 500


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_body, path=st.sampled_from([CHAT, COMP, EXPLAIN]))
def test_fuzz_server_never_answers_5xx(server, body, path):
    body = {**body, "max_tokens": 2, "stream": False}  # keep valid ones quick
    conn = keep_alive(server)
    try:
        code, out = post(conn, path, json.dumps(body).encode())
        assert code < 500, out
        code, _ = post(conn, CHAT, raw(CHAT_OK))
        assert code == 200
    finally:
        conn.close()


# ------------------------------------------------------------------ the official client
OPENAI_HOSTILE = [
    (dict(temperature=1e-300), "temperature"), (dict(top_p=1e-300), "top_p"),
    (dict(seed=2**64), "seed"), (dict(extra_body={"top_k": 2**63}), "top_k"),
    (dict(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    (dict(messages=[{"role": "bogus", "content": "hi"}]), "messages[0].role"),
]


@pytest.mark.parametrize("kw,param", OPENAI_HOSTILE, ids=[p for _, p in OPENAI_HOSTILE])
def test_openai_client_gets_400_naming_the_field(client, model_name, kw, param):
    import openai

    args = {"model": model_name, "messages": MSGS, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param
    ok = client.chat.completions.create(model=model_name, messages=MSGS, max_tokens=2)
    assert ok.usage.completion_tokens >= 1
