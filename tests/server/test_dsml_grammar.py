"""The DSML call grammar of a forced tool choice on DeepSeek-V4 / V4.1: it accepts a call
exactly as deepseek-recipe renders it into history, and every output it lets through (random
walks over the allowed tokens) parses, with the recipe's own stream parser, into calls whose
arguments validate against the tool's schema."""

from __future__ import annotations

import json
import random

import deepseek_recipe as dr
import jsonschema
import pytest
from deepseek_tiny import EOS, make_v4_checkpoint
from grammar_walk import random_walk as walk
from transformers import AutoTokenizer

from deepinfer.errors import RequestError
from deepinfer.server.deepseek_encoding import DeepseekChat
from deepinfer.server.thinking import Thinking
from deepinfer.server.tools.request import parse_tool_request
from deepinfer.structured.grammar import GrammarCompiler

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "code": {"type": "string", "pattern": "^[a-z]{2}$"}}}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}}}}
TOOLS = [WEATHER, FLAG]
VERSIONS = [dr.ModelVersion.DeepseekV4Pro, dr.ModelVersion.DeepseekV41Flash]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4_dsml"))


@pytest.fixture(scope="module")
def tok(ckpt):
    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids(EOS)])


def chat_for(ckpt, tok, version) -> DeepseekChat:
    return DeepseekChat(ckpt, version, [tok.convert_tokens_to_ids(EOS)])


def forced(choice="required", tools=TOOLS, parallel=True):
    return parse_tool_request({"tools": tools, "tool_choice": choice,
                               "parallel_tool_calls": parallel})


USER = [{"role": "user", "content": "Weather in Paris?"}]


def rendered_reply(chat: DeepseekChat, calls: list[dict]) -> str:
    """The reply text the recipe renders for ``calls`` after a forced-choice prompt."""
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": c} for i, c in enumerate(calls)]}] + [
        {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(len(calls))]
    req = forced()
    head = chat.encoding.render_conversation(
        chat.convert(USER, req, Thinking(False)).conversation).prompt
    full = chat.encoding.render_conversation(
        chat.convert(history, req, Thinking(False)).conversation).prompt
    assert full.startswith(head)
    return full[len(head):full.index(EOS, len(head))]


@pytest.mark.parametrize("version", VERSIONS, ids=["v4", "v41"])
def test_the_recipes_rendering_of_calls_is_accepted(ckpt, tok, compiler, version):
    """Arguments in schema order: the grammar writes properties in that order."""
    chat = chat_for(ckpt, tok, version)
    calls = [{"name": "get_weather", "arguments": {"city": 'Pa"ris</b>\n', "days": 3,
                                                   "unit": "c", "tags": ["ab"]}},
             {"name": "flag", "arguments": {}}]
    reply = rendered_reply(chat, calls)
    so = chat.reply_grammar(USER, forced(), Thinking(False))
    state = compiler.matcher(compiler.compile(so))
    assert all(state.accept(t) for t in chat.tokenizer.encode(reply))
    assert state.accept(tok.convert_tokens_to_ids(EOS)) and state.terminated


def random_walk(compiler, grammar, tok, rng, markers: list[int], limit=4000) -> list[int]:
    """Tokens drawn from what the grammar allows (the marker tokens favoured, so the walks
    end), until the grammar completes."""
    return walk(compiler.matcher(grammar), len(tok), tok.convert_tokens_to_ids(EOS), rng,
                markers, limit=limit)


@pytest.mark.parametrize("version", VERSIONS, ids=["v4", "v41"])
@pytest.mark.parametrize("choice, parallel", [("required", True), ("named", False)])
def test_every_output_parses_into_calls_that_validate(ckpt, tok, compiler, version, choice,
                                                      parallel):
    chat = chat_for(ckpt, tok, version)
    tc = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" \
        else "required"
    req = forced(tc, parallel=parallel)
    grammar = compiler.compile(chat.reply_grammar(USER, req, Thinking(False)))
    conv = chat.convert(USER, req, Thinking(False))
    dsml = tok.convert_tokens_to_ids(dr.SpecialToken.Dsml.default_str())
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(0)
    for _ in range(6):
        ids = random_walk(compiler, grammar, tok, rng, [dsml])
        out = chat.parse(conv, ids, "r", limit=None if parallel else 1)
        assert out.calls and out.content == ""
        assert len(out.calls) == 1 or parallel
        for c in out.calls:
            assert choice != "named" or c.name == "get_weather"
            jsonschema.validate(json.loads(c.arguments_json), schemas[c.name])


def test_a_schema_the_grammar_cannot_express_names_the_tool(ckpt, tok):
    chat = chat_for(ckpt, tok, VERSIONS[0])
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "minProperties": 1, "properties": {"a": {"type": "string"}}}}}
    with pytest.raises(RequestError) as e:
        chat.reply_grammar(USER, forced(tools=[WEATHER, odd]), Thinking(False))
    assert e.value.field == "tools[1].function.parameters"


# ------------------------------------------------- response_format: reasoning, then JSON or calls
ANSWER = {"type": "object", "required": ["city", "n"], "additionalProperties": False,
          "properties": {"city": {"enum": ["Paris", "Rome"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "note": {"type": "string", "maxLength": 5}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


@pytest.mark.parametrize("version", VERSIONS, ids=["v4", "v41"])
def test_reasoning_then_a_json_answer_is_accepted_and_split(ckpt, tok, compiler, version):
    """Reasoning is any text (JSON-looking text and "<" included) up to the end tag; the
    answer after it is the schema's JSON, parsed as content."""
    chat = chat_for(ckpt, tok, version)
    req = parse_tool_request({})
    so = chat.reply_grammar(USER, req, Thinking(True), JSON_FORMAT)
    state = compiler.matcher(compiler.compile(so))
    reasoning = 'Let me see: {"city": 1} <b> / done'
    answer = '{"city":"Rome","n":7}'
    end = tok.convert_tokens_to_ids(dr.SpecialToken.ThinkingEnd.default_str())
    eos = tok.convert_tokens_to_ids(EOS)
    ids = chat.tokenizer.encode(reasoning) + [end] + chat.tokenizer.encode(answer) + [eos]
    assert all(state.accept(t) for t in ids) and state.terminated
    out = chat.parse(chat.convert(USER, req, Thinking(True), None, JSON_FORMAT), ids, "r")
    assert (out.reasoning, out.content, out.calls) == (reasoning, answer, [])


@pytest.mark.parametrize("version", VERSIONS, ids=["v4", "v41"])
def test_the_answer_cannot_start_inside_the_reasoning_nor_end_it_early(ckpt, tok, compiler,
                                                                       version):
    chat = chat_for(ckpt, tok, version)
    so = chat.reply_grammar(USER, parse_tool_request({}), Thinking(True), JSON_FORMAT)
    grammar = compiler.compile(so)
    eos = tok.convert_tokens_to_ids(EOS)
    end = tok.convert_tokens_to_ids(dr.SpecialToken.ThinkingEnd.default_str())
    state = compiler.matcher(grammar)
    assert all(state.accept(t) for t in chat.tokenizer.encode("hmm"))
    assert not state.accept(eos)  # the reply cannot stop while thinking
    state = compiler.matcher(grammar)
    assert state.accept(end)
    assert not state.accept(chat.tokenizer.encode("x")[0])  # the answer is JSON only
    without = compiler.compile(chat.reply_grammar(USER, parse_tool_request({}), Thinking(False),
                                                  JSON_FORMAT))
    assert not compiler.matcher(without).accept(end)  # thinking off: the prompt closed it


@pytest.mark.parametrize("version", VERSIONS, ids=["v4", "v41"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
@pytest.mark.parametrize("fmt", ["json_schema", "json_object"])
def test_auto_with_response_format_gives_calls_or_a_json_answer(ckpt, tok, compiler, version,
                                                                thinking, fmt):
    """tool_choice auto + response_format: every output the grammar lets through parses into
    either calls that validate (no content) or a content that is the format's JSON (no
    calls), with the reasoning apart; random walks reach both branches."""
    chat = chat_for(ckpt, tok, version)
    req = parse_tool_request({"tools": TOOLS, "tool_choice": "auto"})
    rf = JSON_FORMAT if fmt == "json_schema" else {"type": "json_object"}
    messages = [{"role": "user", "content": "Weather in Paris? Reply in JSON."}]
    grammar = compiler.compile(chat.reply_grammar(messages, req, Thinking(thinking), rf))
    conv = chat.convert(messages, req, Thinking(thinking), None, rf)
    dsml = tok.convert_tokens_to_ids(dr.SpecialToken.Dsml.default_str())
    end = tok.convert_tokens_to_ids(dr.SpecialToken.ThinkingEnd.default_str())
    close = chat.tokenizer.encode('"}')  # favoured too, so JSON objects end
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(1)
    branches = set()
    for _ in range(8):
        ids = random_walk(compiler, grammar, tok, rng, [end, dsml] + close)
        out = chat.parse(conv, ids, "r")
        assert (out.reasoning is not None) == thinking
        if out.calls:
            branches.add("calls")
            assert out.content == ""
            for c in out.calls:
                jsonschema.validate(json.loads(c.arguments_json), schemas[c.name])
        else:
            branches.add("json")
            answer = json.loads(out.content)
            jsonschema.validate(answer, ANSWER if fmt == "json_schema" else {"type": "object"})
    assert branches == {"calls", "json"}
