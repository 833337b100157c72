"""DeepSeek-V4 chats through deepseek-recipe: prompt ids equal the recipe's own encoding, replies
(recorded in the shape V4 writes them) split into reasoning, content and DSML tool calls, whole
and token by token, and a tool loop's turn k+1 extends turn k token for token."""

from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from deepseek_tiny import EOS, SPECIALS, make_v4_checkpoint

from deepinfer.errors import RequestError
from deepinfer.server.deepseek_encoding import DeepseekChat, DeepseekPromptBuilder, use_recipe
from deepinfer.server.thinking import Thinking, parse_thinking
from deepinfer.server.tools import ToolRequest
from deepinfer.server.tools.request import parse_tool_request

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
DSML = "｜DSML｜"


def dsml_calls(*calls: tuple[str, dict]) -> str:
    """Tool calls as V4 writes them (strings raw, other values as JSON)."""
    out = [f"<{DSML}tool_calls>"]
    for name, args in calls:
        out.append(f'<{DSML}invoke name="{name}">')
        for k, v in args.items():
            s = isinstance(v, str)
            out.append(f'<{DSML}parameter name="{k}" string="{str(s).lower()}">'
                       f'{v if s else json.dumps(v)}</{DSML}parameter>')
        out.append(f"</{DSML}invoke>")
    return "\n".join(out) + f"\n</{DSML}tool_calls>"


# (thinking, tool_choice, reply after the prompt, reasoning, content, calls)
RECORDED = [
    (True, "auto", f"The user greets me.</think>Hello! How can I help?{EOS}",
     "The user greets me.", "Hello! How can I help?", []),
    (True, "auto", "I need the weather tool.</think>\n\n"
     + dsml_calls(("get_weather", {"city": "Paris", "days": 3})) + EOS,
     "I need the weather tool.", "", [("get_weather", {"city": "Paris", "days": 3})]),
    (False, "auto", "Let me check both.\n\n" + dsml_calls(("get_weather", {"city": "Paris"}),
                                                        ("get_weather", {"city": "Rome"})) + EOS,
     None, "Let me check both.", [("get_weather", {"city": "Paris"}),
                                  ("get_weather", {"city": "Rome"})]),
    (False, "auto", f"Paris is sunny.{EOS}", None, "Paris is sunny.", []),
    # tool_choice required: the prompt opened the call block, the reply starts inside it
    (False, "required", dsml_calls(("get_weather", {"city": "Rome", "days": 2}))
     .split("\n", 1)[1] + EOS, None, "", [("get_weather", {"city": "Rome", "days": 2})]),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_recipe"))


@pytest.fixture(scope="module")
def chat(ckpt):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(ckpt).convert_tokens_to_ids(EOS)
    return DeepseekChat(ckpt, dr.ModelVersion.DeepseekV4Pro, [eos])


@pytest.fixture(scope="module")
def builder(ckpt, chat):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return DeepseekPromptBuilder(chat, tok, [tok.convert_tokens_to_ids(EOS)], 1 << 20)


def tool_request(tools=None, choice=None) -> ToolRequest:
    body = {"tools": tools} if tools else {}
    if choice is not None:
        body["tool_choice"] = choice
    return parse_tool_request(body)


def recipe_ids(chat: DeepseekChat, messages: list, thinking: bool, effort: str | None = "high",
               tools=(), choice: str = "auto") -> tuple[list[int], str]:
    """The recipe's own encoding of a conversation built from its classes, and its text."""
    conv = dr.Conversation(messages, thinking_mode=thinking, reasoning_effort=effort if thinking
                           else None, tools=[dr.ToolDefinition(
                               t["function"]["name"], t["function"].get("description"),
                               t["function"].get("parameters")) for t in tools] or None,
                           tool_choice=choice)
    return list(chat.encoding.encode(conv)), chat.encoding.render_conversation(conv).prompt


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "What is the weather in Paris?"}], Thinking(), [],
     [dr.UserMessage("What is the weather in Paris?")], True, "high"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     Thinking(False), [], [dr.SystemMessage("Be brief."), dr.UserMessage("Hi")], False, None),
    ([{"role": "user", "content": "Weather?"}], Thinking(True, "max"), [WEATHER],
     [dr.UserMessage("Weather?")], True, "max"),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
       "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], Thinking(), [WEATHER],
     [dr.UserMessage("Weather in Paris?"),
      dr.AssistantMessage("", reasoning_content="Use the tool.", tool_calls=[
          dr.ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
      dr.ToolMessage("sunny", "call_1")], True, "high"),
]


@pytest.mark.parametrize("messages, thinking, tools, recipe_messages, mode, effort",
                         CONVERSATIONS,
                         ids=["user", "system-no-thinking", "tools-max", "tool-loop"])
def test_prompt_ids_equal_the_recipes_own_encoding(builder, chat, messages, thinking, tools,
                                                   recipe_messages, mode, effort):
    built = builder.chat(messages, None, tools, tool_request(tools), thinking)
    ids, text = recipe_ids(chat, recipe_messages, mode, effort, tools)
    assert built.token_ids == ids and built.encoding == "rendered"
    assert builder.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert text.endswith("<｜Assistant｜><think>" if mode else "<｜Assistant｜></think>")


def test_thinking_is_read_as_deepseek_and_vllm_clients_send_it():
    assert parse_thinking({"thinking": {"type": "disabled"}}) == Thinking(False)
    assert parse_thinking({"chat_template_kwargs": {"thinking": True},
                           "reasoning_effort": "max"}) == Thinking(True, "max")
    assert parse_thinking({}) == Thinking()
    for body, field in [({"thinking": {"type": "on"}}, "thinking"),
                        ({"chat_template_kwargs": {"thinking": "yes"}},
                         "chat_template_kwargs.thinking"),
                        ({"reasoning_effort": 3}, "reasoning_effort")]:
        with pytest.raises(RequestError) as e:
            parse_thinking(body)
        assert e.value.field == field


@pytest.mark.parametrize("thinking, choice, field", [
    (Thinking(), "required", "tool_choice"),  # the official API: no forced calls while thinking
    (Thinking(True, "bogus"), None, "reasoning_effort"),
])
def test_what_the_official_api_rejects_is_a_400_naming_the_field(chat, thinking, choice, field):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as e:
        chat.convert(messages, tool_request([WEATHER], choice), thinking)
    assert e.value.field == field


def recorded(chat, thinking, choice):
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    return chat.convert(messages, tool_request([WEATHER], choice), Thinking(thinking))


@pytest.mark.parametrize("thinking, choice, reply, reasoning, content, calls", RECORDED)
def test_recorded_replies_parse_into_reasoning_content_and_calls(chat, thinking, choice, reply,
                                                                 reasoning, content, calls):
    ids = list(chat.tokenizer.encode(reply))
    out = chat.parse(recorded(chat, thinking, choice), ids, "req-1")
    assert (out.reasoning, out.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in out.calls] == calls
    assert all(json.loads(c.arguments_json) == c.arguments and c.id.startswith("call_")
               for c in out.calls)

    # token by token: the deltas add up to the whole parse; each call is announced first
    stream = chat.reply_stream(recorded(chat, thinking, choice), "req-1")
    pieces = [stream.push("", [t]) for t in ids] + [stream.finish(None, [])]
    assert "".join(p.content for p in pieces) == out.content
    assert "".join(p.reasoning for p in pieces) == (out.reasoning or "")
    deltas = [d for p in pieces for d in p.calls]
    for i, c in enumerate(out.calls):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name) == (c.id, c.name)
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == c.arguments_json
        assert len([d for d in mine if d.arguments]) > 1  # arguments arrive as written


def test_parallel_tool_calls_false_keeps_the_first_call(chat):
    reply = RECORDED[2][2]
    out = chat.parse(recorded(chat, False, "auto"), list(chat.tokenizer.encode(reply)), "r",
                     limit=1)
    assert [c.arguments for c in out.calls] == [{"city": "Paris"}]


def reply_message(out) -> dict:
    """The assistant message a client sends back (normalized as the protocol does)."""
    m = {"role": "assistant", "content": out.content,
         "tool_calls": [c.to_message() for c in out.calls]}
    if out.reasoning is not None:
        m["reasoning_content"] = out.reasoning
    return m if out.calls else {k: v for k, v in m.items() if k != "tool_calls"}


def test_tool_loop_turn_extends_the_previous_prompt_and_reply(builder, chat):
    """Thinking on, with tools: the encoding keeps the reply's reasoning, so turn 2 is
    turn 1's prompt + the generated reply ids + the tool result, and equals the official ids."""
    tools, req = [WEATHER], tool_request([WEATHER])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = builder.chat(messages, None, tools, req, Thinking())
    reply_ids = list(chat.tokenizer.encode(RECORDED[1][2]))
    out = chat.parse(chat.convert(messages, req, Thinking()), reply_ids, "req-1")
    builder.remember(first.key_state, first.token_ids, reply_ids, reply_message(out))
    messages += [reply_message(out), {"role": "tool", "tool_call_id": out.calls[0].id,
                                      "content": "sunny"}]
    second = builder.chat(messages, None, tools, req, Thinking())
    assert second.encoding == "extended" and not second.history_rewritten
    assert second.token_ids[:len(first.token_ids) + len(reply_ids)] == first.token_ids + reply_ids
    assert second.token_ids == chat.encode(chat.convert(messages, req, Thinking()))


def test_thinking_chat_without_tools_drops_earlier_reasoning(builder, chat):
    """The official encoding drops a reply's reasoning once a user message follows (no
    tools): the prompt stays the official one and says history was rewritten."""
    req = tool_request()
    messages = [{"role": "user", "content": "Hi"}]
    first = builder.chat(messages, None, [], req, Thinking())
    reply_ids = list(chat.tokenizer.encode(RECORDED[0][2]))
    out = chat.parse(chat.convert(messages, req, Thinking()), reply_ids, "req-2")
    builder.remember(first.key_state, first.token_ids, reply_ids, reply_message(out))
    messages += [reply_message(out), {"role": "user", "content": "Weather?"}]
    second = builder.chat(messages, None, [], req, Thinking())
    assert (second.encoding, second.history_rewritten) == ("rendered", True)
    assert second.token_ids == chat.encode(chat.convert(messages, req, Thinking()))


def test_recipe_is_chosen_from_the_checkpoint_or_the_flag():
    v4 = {"architectures": ["DeepseekV4ForCausalLM"]}
    assert use_recipe("auto", v4) == dr.ModelVersion.DeepseekV4Pro
    assert use_recipe(None, {**v4, "kv_source_layers": [0]}) == dr.ModelVersion.DeepseekV41Flash
    v41 = dr.ModelVersion.DeepseekV41Flash  # as our DeepseekV41Config writes it, or by NeMo's field
    assert use_recipe("auto", {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"}) == v41
    assert use_recipe("auto", {**v4, "kv_source_layer_ids": [0, 0]}) == v41
    assert use_recipe("hermes", v4) is None  # another parser named: the HF template path
    assert use_recipe("auto", {"architectures": ["LlamaForCausalLM"]}) is None
    assert use_recipe("deepseek_v4", {}) == dr.ModelVersion.DeepseekV4Pro


def test_special_tokens_are_single_ids(chat):
    assert all(len(chat.tokenizer.encode(s)) == 1 for s in SPECIALS)


@pytest.mark.parametrize("thinking", [True, False])
def test_response_format_is_rendered_as_the_recipes_own_conversation(builder, chat, thinking):
    """The schema goes into the prompt as the recipe's ``Conversation(response_schema=...)``
    renders it, in the client's key order (not sorted)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "string"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": "Weather?"}]
    built = builder.chat(messages, None, [], tool_request(), Thinking(thinking), rf)
    conv = dr.Conversation([dr.UserMessage("Weather?")], thinking_mode=thinking,
                           reasoning_effort="high" if thinking else None, response_schema=schema)
    assert built.token_ids == list(chat.encoding.encode(conv))
    text = chat.encoding.render_conversation(conv).prompt
    assert text.index('"zeta"') < text.index('"alpha"')
