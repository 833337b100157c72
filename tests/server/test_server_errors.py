"""Bad requests get a 4xx naming the problem, and the server keeps serving; API keys."""

import httpx
import openai
import pytest
from server_helpers import start_server

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

BAD = [
    # (path, body (dict, or raw bytes), status, param, words in the message)
    (CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, b"", 400, None, "empty"),
    (CHAT, {"messages": "hi"}, 400, "messages", "array"),
    (CHAT, {"messages": []}, 400, "messages", "at least one"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role", "non-empty string"),
    (CHAT, {"messages": MSGS, "temperature": "hot"}, 400, "temperature", "number"),
    (CHAT, {"messages": MSGS, "temperature": -1}, 400, "temperature", "0 (greedy)"),
    (CHAT, {"messages": MSGS, "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    (CHAT, {"messages": MSGS, "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    (CHAT, {"messages": MSGS, "max_tokens": 10**9}, 400, "max_tokens", "512"),
    (CHAT, {"messages": MSGS, "n": 0}, 400, "n", ">= 1"),
    (CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream", "boolean"),
    (CHAT, {"messages": MSGS, "stop": 5}, 400, "stop", "string"),
    (CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p", "[1e-06, 1]"),
    (CHAT, {"messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSGS, "cache_salt": 7}, 400, "cache_salt", "string"),
    (CHAT, {"messages": MSGS, "presence_penalty": 3.0}, 400, "presence_penalty", "<= 2"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools[0].function",
     "must be an object"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 600}]}, 400, "messages", "512"),
    (CHAT, {"messages": MSGS, "model": "gpt-9"}, 404, "model", "does not exist"),
    (COMP, {"prompt": list(range(3, 300)) * 2}, 400, "prompt", "512"),
    (COMP, {"prompt": [10**6]}, 400, "prompt", "token ids"),
    (COMP, {"prompt": [1.5, 2]}, 400, "prompt", "token ids"),
    (COMP, {"prompt": ["a", "b"]}, 400, "prompt", "batched"),
    (COMP, {"prompt": ""}, 400, "prompt", "empty"),
    (COMP, {}, 400, "prompt", "required"),
    (COMP, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "<= 20"),
    (COMP, {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("/v1/nope", {}, 404, None, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD,
                         ids=[f"{i}-{b[3] or b[4]}" for i, b in enumerate(BAD)])
def test_bad_request_then_good_request(server, path, body, status, param, words):
    with httpx.Client(base_url=server.url, timeout=60) as hc:
        if isinstance(body, bytes):
            r = hc.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = hc.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param
        assert words in err["message"] and err["type"]
        ok = hc.post(CHAT, json={"messages": MSGS, "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_bad_request_mid_stream_client_keeps_server_serving(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=MSGS, max_tokens=-1,
                                       stream=True)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown", messages=MSGS, max_tokens=1)
    assert client.chat.completions.create(model=model_name, messages=MSGS,
                                          max_tokens=1).usage.completion_tokens == 1


def test_api_key_is_enforced_except_on_health(tiny_llama):
    srv = start_server(tiny_llama, api_key="s3cret")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as hc:
            assert hc.get("/health").status_code == 200
            for path in ("/v1/models", "/metrics"):
                assert hc.get(path).status_code == 401
                assert hc.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
                assert hc.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
            r = hc.post(CHAT, json={"messages": MSGS, "max_tokens": 1})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert hc.post("/v1/cache/explain", json={"prompt": "hi"}).status_code == 401
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        r = good.chat.completions.create(model=srv.server_obj.model_name, messages=MSGS,
                                         max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        srv.stop()
