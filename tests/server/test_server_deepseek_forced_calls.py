"""``tool_choice`` required / named on a live DeepSeek-V4 server: the random-weight model is
held to DSML calls by the grammar, so the official client gets ``tool_calls`` whose arguments
validate, streamed (deltas add up) and not; a forced tool loop's next turn still extends the
previous prompt and reply; what cannot be forced is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from v4_server import v4_server_fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

# bounded values (enum, integer range, short strings), so a random model's call always ends
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 4}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
OFF = {"thinking": {"type": "disabled"}}  # the official API forces calls only without thinking


srv, client = v4_server_fixtures("tiny_v4_forced")


def ask(srv, client, messages, choice, **kw):
    """One forced call (a random model given parallel calls may go on calling until
    ``max_tokens``; the grammar of several calls is tested in test_dsml_grammar.py)."""
    return client.chat.completions.with_raw_response.create(
        model=srv.server_obj.model_name, messages=messages, tools=[WEATHER, TIME],
        tool_choice=choice, temperature=0, max_tokens=160, extra_body=OFF,
        parallel_tool_calls=False, **kw)


def assert_valid(calls, names=tuple(SCHEMAS)):
    assert calls
    for c in calls:
        assert c.function.name in names and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate_streamed_and_not(srv, client, choice):
    tc = {"type": "function", "function": {"name": "get_time"}} if choice == "named" \
        else "required"
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ask(srv, client, messages, tc).parse()
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls" and not msg.message.content
    assert_valid(msg.message.tool_calls, ["get_time"] if choice == "named" else SCHEMAS)

    stream = client.chat.completions.create(
        model=srv.server_obj.model_name, messages=messages, tools=[WEATHER, TIME],
        tool_choice=tc, temperature=0, max_tokens=160, extra_body=OFF, stream=True,
        parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in msg.message.tool_calls]


def test_the_next_turn_of_a_forced_call_extends_it(srv, client):
    """The tool result's turn (forced again) extends the previous prompt + reply token for
    token."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    for turn in range(2):
        raw = ask(srv, client, messages, "required")
        r = raw.parse()
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        assert_valid(calls)
        if turn:
            assert raw.headers["x-deepinfer-prompt-encoding"] == "extended"
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]


def test_what_cannot_be_forced_is_a_400_naming_the_field(srv, client):
    user = [{"role": "user", "content": "hi"}]
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "anyOf": [{"required": ["a"]}], "properties": {"a": {"type": "integer"}}}}}
    cases = [
        (dict(tools=[odd], tool_choice="required", extra_body=OFF), "tools[0].function.parameters"),
        (dict(tools=[WEATHER], tool_choice="required"), "tool_choice"),  # thinking on
        (dict(tools=[WEATHER], tool_choice="required", extra_body=OFF,
              response_format={"type": "json_object"}), "tool_choice"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=srv.server_obj.model_name, messages=user,
                                           max_tokens=4, **kw)
        assert e.value.body["param"] == field, kw
    ok = ask(srv, client, user, "required").parse()  # the server keeps serving
    assert_valid(ok.choices[0].message.tool_calls)
