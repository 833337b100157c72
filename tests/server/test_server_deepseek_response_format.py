"""``response_format`` on a live DeepSeek-V4 server, with the official client: with thinking on
the reasoning is free up to ``</think>`` and the answer after it is the schema's JSON
(``reasoning_content`` and ``content`` apart); with ``tool_choice`` auto the answer is either
that JSON or DSML calls that validate; streamed deltas add up to the non-streamed reply; what
the official API refuses is a 400 naming the field.

The random-weight model is steered only by ``logit_bias`` and penalties (which branch, how long
it thinks); validity comes from the grammar alone.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from deepseek_tiny import SPECIALS
from transformers import AutoTokenizer
from v4_server import v4_server_fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

ANSWER = {"type": "object", "required": ["city", "n"], "additionalProperties": False,
          "properties": {"city": {"enum": ["Paris", "Rome"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "note": {"type": "string", "maxLength": 5}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city", "days"],
                                          "properties": {
                                              "city": {"type": "string", "enum": ["Paris", "Rome"]},
                                              "days": {"type": "integer", "minimum": 1,
                                                       "maximum": 7}}}}}
USER = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


srv, client = v4_server_fixtures("tiny_v4_format", timeout=600)


@pytest.fixture(scope="module")
def ids(srv):
    tok = AutoTokenizer.from_pretrained(srv.server_obj.async_engine.engine.checkpoint_path)
    one = lambda text: str(tok.encode(text, add_special_tokens=False)[0])  # noqa: E731
    return {"think_end": str(tok.convert_tokens_to_ids(SPECIALS[3])), "newline": one("\n"),
            "brace": one("{"), "a": one("a")}


def both(srv, client, **kw) -> tuple[object, dict]:
    """The non-streamed reply, and the streamed one added up (reasoning, content, calls)."""
    kw = dict(model=srv.server_obj.model_name, messages=USER, temperature=0, max_tokens=96,
              **kw)
    r = client.chat.completions.create(**kw).choices[0]
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            out["finish"] = ch.finish_reason or out["finish"]
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            out["content"] += d.content or ""
            for c in d.tool_calls or []:
                call = out["calls"].setdefault(c.index, ["", ""])
                call[0] += (c.function.name or "") if c.function else ""
                call[1] += (c.function.arguments or "") if c.function else ""
    assert out["finish"] == r.finish_reason
    assert out["reasoning"] == (getattr(r.message, "reasoning_content", None) or "")
    assert out["content"] == (r.message.content or "")
    assert [tuple(c) for _, c in sorted(out["calls"].items())] == \
        [(c.function.name, c.function.arguments) for c in r.message.tool_calls or []]
    return r, out


def test_thinking_then_a_json_answer(srv, client, ids):
    """"a" favoured, presence / frequency penalties wearing it down, ``</think>`` next best:
    a few tokens of reasoning, then the end tag, then JSON that validates."""
    r, _ = both(srv, client, response_format=FORMAT, presence_penalty=2.0, frequency_penalty=2.0,
                logit_bias={ids["a"]: 60, ids["think_end"]: 55})
    assert r.finish_reason == "stop"
    assert r.message.reasoning_content and set(r.message.reasoning_content) == {"a"}
    jsonschema.validate(json.loads(r.message.content), ANSWER)
    assert not r.message.tool_calls


def test_without_thinking_the_reply_is_the_json(srv, client):
    r, _ = both(srv, client, response_format=FORMAT,
                extra_body={"thinking": {"type": "disabled"}})
    assert r.finish_reason == "stop" and getattr(r.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(r.message.content), ANSWER)


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
@pytest.mark.parametrize("branch", ["calls", "json"])
def test_auto_tools_with_response_format_calls_or_json(srv, client, ids, thinking, branch):
    """After the reasoning the answer is "{" (JSON) or "\\n\\n" and the call block: the
    favoured token picks the branch, the grammar holds each branch to its schema."""
    bias = {ids["newline" if branch == "calls" else "brace"]: 50, ids["think_end"]: 100}
    r, _ = both(srv, client, response_format=FORMAT, tools=[WEATHER], tool_choice="auto",
                parallel_tool_calls=False, logit_bias=bias,
                extra_body={"thinking": {"type": thinking}})
    msg = r.message
    assert (getattr(msg, "reasoning_content", None) is not None) == (thinking == "enabled")
    if branch == "calls":
        assert r.finish_reason == "tool_calls" and not msg.content
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments),
                            WEATHER["function"]["parameters"])
    else:
        assert r.finish_reason == "stop" and not msg.tool_calls
        jsonschema.validate(json.loads(msg.content), ANSWER)


def test_refusals_are_400s_naming_the_field(srv, client):
    """The official API's rule: json_object needs the word "json" in the prompt; a forced
    call cannot also be JSON."""
    cases = [(dict(messages=[{"role": "user", "content": "hi"}],
                   response_format={"type": "json_object"}), "response_format"),
             (dict(messages=USER, response_format=FORMAT, tools=[WEATHER],
                   tool_choice="required", extra_body={"thinking": {"type": "disabled"}}),
              "tool_choice")]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=srv.server_obj.model_name, max_tokens=4, **kw)
        assert e.value.body["param"] == field, kw
    r = client.chat.completions.create(model=srv.server_obj.model_name, messages=USER,
                                       max_tokens=96, temperature=0, response_format=FORMAT,
                                       extra_body={"thinking": {"type": "disabled"}})
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)  # still serving
