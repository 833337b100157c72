"""Anthropic ``thinking`` on a live DeepSeek-V4 server with the official anthropic client: the
reasoning comes back as a thinking block before the text (streamed as thinking_delta events,
adding up to the non-streamed block, equal to the OpenAI path's reasoning_content), and a
conversation that passes the thinking blocks back gets the prompt the OpenAI path builds from
reasoning_content: extended, or reported rewritten, alike."""

from __future__ import annotations

import anthropic
import openai
import pytest
from deepseek_tiny import make_v4_checkpoint
from server_helpers import start_server

pytestmark = pytest.mark.usefixtures("one_thread")

ON = {"type": "enabled", "budget_tokens": 8}
GREEDY = {"temperature": 0}  # (anthropic 2.x has no temperature argument)
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(make_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_thinking")),
                     engine_kw=dict(max_model_len=2048, max_num_batched_tokens=2048),
                     served_model_name="v4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def aclient(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)


def test_thinking_block_streamed_and_not(srv, aclient):
    kw = dict(model="v4", max_tokens=24, messages=USER, thinking=ON, extra_body=GREEDY)
    r = aclient.messages.create(**kw)
    assert r.content[0].type == "thinking" and r.content[0].signature == r.id
    assert all(b.type != "thinking" for b in r.content[1:])

    with aclient.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert thinking == r.content[0].thinking
    assert [b.type for b in final.content] == [b.type for b in r.content]
    assert [getattr(b, "text", None) for b in final.content] == \
        [getattr(b, "text", None) for b in r.content]
    assert final.content[0].signature == final.id

    chat = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    o = chat.chat.completions.create(model="v4", messages=USER, temperature=0, max_tokens=24)
    assert o.choices[0].message.reasoning_content == r.content[0].thinking  # the same reasoning

    off = aclient.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert all(b.type != "thinking" for b in off.content)


@pytest.mark.parametrize("tools", [[TOOL], None], ids=["tools", "no-tools"])
def test_thinking_blocks_sent_back_build_the_openai_paths_prompt(srv, aclient, tools):
    """Turn 2 after a thinking reply, sent back as thinking blocks (Anthropic) or as
    reasoning_content (OpenAI): the same prompt, extended or reported rewritten alike."""
    extra = {"tools": tools} if tools else {}
    first = aclient.messages.create(model="v4", max_tokens=12, messages=USER, thinking=ON,
                                    extra_body=GREEDY, **extra)
    assert first.content[0].type == "thinking"
    a_messages = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                           for b in first.content]},
                         {"role": "user", "content": "And tomorrow?"}]
    second = aclient.messages.with_raw_response.create(
        model="v4", max_tokens=12, messages=a_messages, thinking=ON, extra_body=GREEDY, **extra)

    chat = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    o_tools = [{"type": "function", "function": {"name": TOOL["name"], "description":
                TOOL["description"], "parameters": TOOL["input_schema"]}}] if tools else None
    o_kw = dict(model="v4", temperature=0, max_tokens=12, **({"tools": o_tools} if tools else {}))
    o_first = chat.chat.completions.create(messages=USER, **o_kw).choices[0].message
    assert o_first.reasoning_content == first.content[0].thinking
    o_messages = USER + [o_first.model_dump(exclude_none=True),
                         {"role": "user", "content": "And tomorrow?"}]
    o_second = chat.chat.completions.with_raw_response.create(messages=o_messages, **o_kw)
    for h in ("x-deepinfer-prompt-encoding", "x-deepinfer-history-rewritten"):
        assert second.headers.get(h) == o_second.headers.get(h), h
    u, ou = second.parse().usage, o_second.parse().usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == \
        ou.prompt_tokens


def test_bad_thinking_is_a_400_naming_the_field(aclient):
    for thinking, field in [({"type": "sometimes"}, "thinking.type"),
                            ({"type": "enabled", "budget_tokens": 50}, "thinking.budget_tokens")]:
        with pytest.raises(anthropic.BadRequestError) as e:
            aclient.messages.create(model="v4", max_tokens=20, messages=USER, thinking=thinking)
        assert e.value.body["error"]["message"].startswith(field)
