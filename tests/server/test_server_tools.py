"""Tool calling through the official openai client against a live server.

The model is ``tool_model``'s tiny Llama trained to answer each turn of a tool loop with one
Hermes-style call, so these tests check the whole path: tools rendered by the checkpoint's
template, the reply parsed into ``tool_calls`` (streamed and not), tool results fed back
prefix-stably so every step of the loop hits the cache.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_helpers import PAGE, start_server
from tool_model import ARGUMENTS, SYSTEM, TASK, TOOLS, make_tool_caller, tool_result

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    srv = start_server(make_tool_caller(tmp_path_factory.mktemp("tool_caller")),
                       served_model_name="m")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tclient(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def start_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


def test_tool_call_parsed_nonstreamed_and_streamed(tclient):
    r = tclient.chat.completions.create(model="m", messages=start_messages(), tools=TOOLS,
                                        temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "search" and json.loads(call.function.arguments) == ARGUMENTS

    chunks = list(tclient.chat.completions.create(
        model="m", messages=start_messages(), tools=TOOLS, temperature=0, max_tokens=40,
        stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # the header first (index, id, name), then argument fragments as the model writes them;
    # how many depends on timing (a reader that falls behind, or a speculative step's several
    # tokens, gets merged deltas), so fragmenting itself is tested on ToolCallStream
    # (test_tool_parsers.py)
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "search"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, arguments) per call, added up from the chunks' ``tool_calls`` deltas."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name_args = calls.setdefault(tc.index, ["", ""])
            name_args[0] += tc.function.name or ""
            name_args[1] += tc.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def test_five_step_tool_loop_hits_the_cache_at_every_step(tool_server, tclient):
    messages = start_messages()
    prev_total = 0
    for step in range(5):
        raw = tclient.chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
        r = raw.parse()
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == ARGUMENTS
        u = r.usage
        if step:
            # turn k+1 extends turn k's prompt + reply token for token: all of it hits
            # but the last partial page
            assert raw.headers["x-deepinfer-prompt-encoding"] == "extended"
            assert u.prompt_tokens_details.cached_tokens >= prev_total - PAGE + 1, step
        prev_total = u.prompt_tokens + u.completion_tokens
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(step)})


def test_tool_choice_none_keeps_the_reply_as_text(tclient):
    r = tclient.chat.completions.create(model="m", messages=start_messages(), tools=TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=40)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "stop"


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a page up.",
    "parameters": {"type": "object", "properties": {"exact": {"type": "boolean"}},
                   "required": ["exact"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_forces_that_tool(tclient, stream):
    """The model was trained to call ``search``; naming ``lookup`` makes the grammar write a
    ``lookup`` call whose arguments follow its schema."""
    kw = dict(model="m", messages=start_messages(), tools=TOOLS + [LOOKUP], temperature=0,
              max_tokens=60, tool_choice={"type": "function", "function": {"name": "lookup"}})
    if not stream:
        r = tclient.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in r.choices[0].message.tool_calls]
    else:
        chunks = list(tclient.chat.completions.create(stream=True, **kw))
        calls = [(name, json.loads(args)) for name, args in streamed_calls(chunks)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and all(name == "lookup" for name, _ in calls)
    assert all(set(args) == {"exact"} and isinstance(args["exact"], bool) for _, args in calls)


def test_required_tool_choice_gives_a_call(tclient):
    r = tclient.chat.completions.create(model="m", messages=start_messages(), tools=TOOLS,
                                        temperature=0, max_tokens=60, tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "search" and "query" in json.loads(call.function.arguments)


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
    "required": ["text"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_with_response_format_still_calls(tclient, stream):
    """The grammar allows the answer JSON or a call: the model, trained to call ``search``,
    calls it (with only the JSON allowed it could not)."""
    kw = dict(model="m", messages=start_messages(), tools=TOOLS, temperature=0, max_tokens=40,
              response_format=ANSWER)
    if not stream:
        choice = tclient.chat.completions.create(**kw).choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        chunks = list(tclient.chat.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        calls = streamed_calls(chunks)
    assert [(name, json.loads(args)) for name, args in calls] == [("search", ARGUMENTS)]


def test_none_tool_choice_with_response_format_answers_the_json(tclient):
    r = tclient.chat.completions.create(model="m", messages=start_messages(), tools=TOOLS,
                                        tool_choice="none", temperature=0, max_tokens=40,
                                        response_format=ANSWER)
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content)) == {"text"}


@pytest.mark.parametrize("tools, extra, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                   "properties": 5}}}],
     {}, "tools[0].function.parameters.properties"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     {}, "tools[0].function.parameters.type"),
    ([{"type": "function", "function": {"name": "bad name!"}}], {}, "tools[0].function.name"),
    ([{"type": "retrieval"}], {}, "tools[0].type"),
    (TOOLS + TOOLS, {}, "tools[1].function.name"),
    (TOOLS, {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    (TOOLS, {"tool_choice": "sometimes"}, "tool_choice"),
    (TOOLS, {"tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    (TOOLS, {"n": 2}, "n"),
    (TOOLS, {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (None, {"tool_choice": "auto"}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(tool_server, tools, extra, param):
    body = {"messages": start_messages(), "max_tokens": 2, **extra}
    if tools is not None:
        body["tools"] = tools
    r = httpx.post(tool_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(tool_server.url + "/health").status_code == 200


def test_bad_tool_call_in_history_is_400(tool_server):
    msgs = start_messages() + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{oops"}}]}]
    r = httpx.post(tool_server.url + "/v1/chat/completions",
                   json={"messages": msgs, "tools": TOOLS, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[2].tool_calls[0].function.arguments"


def test_tools_on_a_template_without_tools_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": start_messages(), "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
