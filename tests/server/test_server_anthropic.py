"""The official anthropic client against ``POST /v1/messages`` on a live server.

Uses ``tool_model``'s tiny Llama trained to answer with a tool call, so tools, ``tool_use``
and ``tool_result`` blocks travel the whole path; checks that usage adds up to the prompt
and that ``cache_control`` marks are cached, reported and pinned.
"""

from __future__ import annotations

from typing import Literal

import anthropic
import httpx
import pydantic
import pytest
from deepinfer.kv.radix import DEVICE
from server_helpers import PAGE, no_lower_tiers, start_server
from tool_model import ARGUMENTS, SYSTEM, TASK, TOOLS, make_tool_caller, tool_result

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0}  # (anthropic 2.x has no temperature argument)
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(make_tool_caller(tmp_path_factory.mktemp("tool_caller")),
                     engine_kw=no_lower_tiers(), served_model_name="m")  # evicted = gone
    yield s
    s.stop()


@pytest.fixture(scope="module")
def aclient(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)


def system(mark: bool = True) -> list[dict]:
    block = {"type": "text", "text": SYSTEM}
    return [{**block, "cache_control": {"type": "ephemeral"}}] if mark else [block]


def prompt_tokens(srv, messages: list[dict]) -> int:
    """The prompt size of the equivalent OpenAI-shaped chat, from the server's /tokenize."""
    body = {"messages": [{"role": "system", "content": SYSTEM}] + messages, "tools": TOOLS}
    return httpx.post(srv.url + "/tokenize", json=body).json()["count"]


def check_usage(u, n_prompt: int) -> None:
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == n_prompt
    assert u.input_tokens >= 1


def test_tool_use_nonstreamed_and_streamed(srv, aclient):
    kw = dict(model="m", max_tokens=40, extra_body=GREEDY, system=system(), tools=A_TOOLS,
              messages=[{"role": "user", "content": TASK}])
    r = aclient.messages.create(**kw)
    assert r.stop_reason == "tool_use" and r.role == "assistant" and r.model == "m"
    (block,) = r.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "search" and block.input == ARGUMENTS
    check_usage(r.usage, prompt_tokens(srv, [{"role": "user", "content": TASK}]))

    with aclient.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "search", ARGUMENTS)]
    assert final.stop_reason == "tool_use"
    check_usage(final.usage, prompt_tokens(srv, [{"role": "user", "content": TASK}]))
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again


def test_cache_control_usage_and_tool_loop_hits(srv, aclient):
    messages = [{"role": "user", "content": TASK}]
    prev_total = 0
    for step in range(4):
        r = aclient.messages.create(model="m", max_tokens=40, system=system(),
                                    extra_body={**GREEDY, "cache_salt": "loop"},  # fresh cache
                                    tools=A_TOOLS, messages=messages)
        u = r.usage
        if step == 0:
            # the system + tools prefix before the mark was computed and is now cached
            assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0
        else:
            assert u.cache_read_input_tokens >= prev_total - PAGE + 1, step
        prev_total = (u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
                      + u.output_tokens)
        (block,) = r.content
        messages.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": tool_result(step)}]})


def test_cache_control_pins_survive_eviction_until_the_ttl(srv, aclient):
    eng = srv.async_engine
    salted = {**GREEDY, "cache_salt": "pin"}
    r = aclient.messages.create(model="m", max_tokens=2, extra_body=salted, system=system(),
                                tools=A_TOOLS, messages=[{"role": "user", "content": "pin me"}])
    created = r.usage.cache_creation_input_tokens
    assert created > 0 and eng.call_sync(lambda: eng.pins.pinned_pages) > 0
    eng.call_sync(lambda: eng.engine.kv.evict(DEVICE))  # evict every unlocked page
    again = aclient.messages.create(model="m", max_tokens=2, extra_body=salted, system=system(),
                                    tools=A_TOOLS, messages=[{"role": "user", "content": "other"}])
    assert again.usage.cache_read_input_tokens >= created  # the pinned prefix was kept

    import time

    eng.call_sync(lambda: eng.pins.expire(time.monotonic() + 3601))
    assert eng.call_sync(lambda: eng.pins.pinned_pages) == 0
    eng.call_sync(lambda: eng.engine.kv.evict(DEVICE))
    third = aclient.messages.create(model="m", max_tokens=2, extra_body=salted, system=system(False),
                                    tools=A_TOOLS, messages=[{"role": "user", "content": "x"}])
    assert third.usage.cache_read_input_tokens == 0  # unpinned: evicted


def test_tool_choice_tool_forces_the_named_tool(aclient):
    lookup = {"name": "lookup", "description": "Look a page up.",
              "input_schema": {"type": "object", "properties": {"exact": {"type": "boolean"}},
                               "required": ["exact"], "additionalProperties": False}}
    r = aclient.messages.create(model="m", max_tokens=60, extra_body=GREEDY, system=system(False),
                                tools=A_TOOLS + [lookup], tool_choice={"type": "tool",
                                                                       "name": "lookup"},
                                messages=[{"role": "user", "content": TASK}])
    assert r.stop_reason == "tool_use" and r.content
    assert all(b.type == "tool_use" and b.name == "lookup" and isinstance(b.input["exact"], bool)
               for b in r.content)


def test_text_reply_without_tools(srv, aclient):
    r = aclient.messages.create(model="m", max_tokens=5, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "hello world"}],
                                stop_sequences=["zzz"])
    assert r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.cache_creation_input_tokens == 0  # no cache_control mark


class Verdict(pydantic.BaseModel):
    ok: bool
    kind: Literal["bug", "feature"]


def test_output_format_is_enforced(aclient):
    """``messages.parse(output_format=...)``: the client sends ``output_config.format``."""
    r = aclient.messages.parse(model="m", max_tokens=40, extra_body=GREEDY,
                               output_format=Verdict,
                               messages=[{"role": "user", "content": "hello world"}])
    assert isinstance(r.parsed_output, Verdict)
    assert r.content[0].type == "text" and Verdict.model_validate_json(r.content[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_output_format_with_tools_still_calls(aclient, stream):
    """tool_choice auto: the answer JSON or tool use; the model trained to call does."""
    fmt = {"format": {"type": "json_schema", "schema": Verdict.model_json_schema()}}
    kw = dict(model="m", max_tokens=40, extra_body=GREEDY, system=system(False),
              tools=A_TOOLS, output_config=fmt, messages=[{"role": "user", "content": TASK}])
    if stream:
        with aclient.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = aclient.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "search", ARGUMENTS)]


@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 3}}]},
     "tools[0].input_schema.properties"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral",
                                                                 "ttl": "2d"}}]},
     "system[0].cache_control.ttl"),
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 5},
     "cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": A_TOOLS},
     "tool_choice.name"),
    ({"tool_choice": {"type": "any"}, "tools": A_TOOLS, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, "tool_choice"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": 5}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
     "output_config.format"),  # found by the grammar compiler
])
def test_bad_requests_are_400_naming_the_field(srv, aclient, extra, field):
    kw = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.create(**kw)
    assert e.value.body["error"]["message"].startswith(field + ":")
    assert httpx.get(srv.url + "/health").status_code == 200
