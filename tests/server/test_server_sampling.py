"""The official openai client with the sampling controls: n > 1 (streamed or not), best_of,
response_format JSON schemas, penalties and logit_bias; bad values get 400 naming the field."""

import json
from collections import defaultdict

import httpx
import jsonschema
import pytest
from server_helpers import wait_idle

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "rank": {"type": "integer", "minimum": 1, "maximum": 20},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["city", "rank", "tags"], "additionalProperties": False}


def computed_prompt_tokens(server) -> int:
    text = httpx.get(server.url + "/metrics").text
    line = next(ln for ln in text.splitlines()
                if ln.startswith("deepinfer:prompt_tokens_computed_total{"))
    return int(float(line.split()[-1]))


def test_chat_n3_shares_one_prefill(server, client, model_name):
    msgs = [{"role": "user", "content": "Prefix caching reuses the key value cache n3"}]
    before = computed_prompt_tokens(server)
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=6, n=3,
                                       temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1
    u = r.usage
    assert u.completion_tokens == 18  # the three samples' tokens; the prompt once
    miss = u.model_extra["prompt_cache_miss_tokens"]
    assert computed_prompt_tokens(server) - before == miss  # computed once, not three times

    chunks = list(client.chat.completions.create(
        model=model_name, messages=msgs, max_tokens=6, n=3, temperature=1.0, seed=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text, roles, finishes = defaultdict(str), defaultdict(int), defaultdict(int)
    for c in chunks:
        for ch in c.choices:
            roles[ch.index] += ch.delta.role == "assistant"
            text[ch.index] += ch.delta.content or ""
            finishes[ch.index] += ch.finish_reason is not None
    assert dict(roles) == dict(finishes) == {0: 1, 1: 1, 2: 1}
    assert [text[i] for i in range(3)] == [c.message.content for c in r.choices]  # same seed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    wait_idle(server)


def test_completions_best_of_returns_n_choices(server, client, model_name):
    r = client.completions.create(model=model_name, prompt=[5, 17, 42, 99, 7, 8, 9],
                                  max_tokens=5, n=2, best_of=4, temperature=1.0, seed=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    with pytest.raises(Exception) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2, best_of=2,
                                  stream=True)
    assert e.value.body["param"] == "best_of"
    wait_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_enforced(client, model_name, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                 "strict": True}}
    for seed in range(3):
        kw = dict(model=model_name, messages=[{"role": "user", "content": "a city?"}],
                  max_tokens=120, temperature=1.0, seed=seed, response_format=rf)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logit_bias_and_penalties_reach_the_sampler(server, client, model_name):
    tok = server.server_obj.engine.tokenizer
    r = client.completions.create(model=model_name, prompt=[5, 17, 42], max_tokens=4,
                                  temperature=0, logit_bias={"77": 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([77] * 4)
    # a presence penalty larger than the bias's margin stops the repeats
    r = client.completions.create(model=model_name, prompt=[5, 17, 42], max_tokens=4,
                                  temperature=0, logit_bias={"77": 5}, presence_penalty=2.0,
                                  frequency_penalty=2.0,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert r.choices[0].text != tok.decode([77] * 4)


MSGS = [{"role": "user", "content": "hi"}]
BAD = [
    ({"n": 10**4}, "n", "max_num_seqs"),
    ({"n": 3, "best_of": 2, "prompt": "hi"}, "best_of", ">= n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "token ids must be in"),
    ({"frequency_penalty": -3}, "frequency_penalty", ">= -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format", "invalid json_schema"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_sampling_fields_get_400_naming_the_field(server, extra, param, words):
    path = "/v1/completions" if "prompt" in extra else "/v1/chat/completions"
    body = {"max_tokens": 2, **({} if "prompt" in extra else {"messages": MSGS}), **extra}
    with httpx.Client(base_url=server.url, timeout=60) as hc:
        r = hc.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        assert hc.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}
                       ).status_code == 200


def test_client_leaving_an_n3_stream_aborts_every_sample(server):
    body = {"messages": MSGS, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as hc:
        with hc.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(8)]  # role chunks, then tokens
            assert any('"index": 2' in ln for ln in seen)
    wait_idle(server)  # fails if any sample kept its pages
