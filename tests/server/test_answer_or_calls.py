"""``tool_choice: auto`` with ``response_format`` on the Hermes and Llama-3 families: the
grammar lets a reply be the JSON answer or tool calls, and ``AnswerOrCallsParser`` reads each
reply back as the branch it took, even where the answer schema looks like a Llama-3 call
(``{"name": ..., "parameters": ...}``). Random walks over the tokens the grammar allows check
every output: calls to the listed tools with valid arguments, or a valid answer, streamed the
same as whole."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from grammar_walk import random_walk as walk
from tiny_checkpoints import make_tokenizer
from transformers import AddedToken

from deepinfer.server.tools import ToolCallStream, get_parser, number_calls
from deepinfer.server.tools.answer_or_calls import AnswerOrCallsParser, answer_or_calls_grammar
from deepinfer.server.tools.request import parse_tool_request
from deepinfer.structured.grammar import GrammarCompiler
from deepinfer.structured.spec import StructuredOutput

EOS = "<|endoftext|>"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}},
    "required": ["query"], "additionalProperties": False}}}
FLAG = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "additionalProperties": False}}}
TOOLS = [SEARCH, FLAG]
# an answer whose objects have the very shape of a Llama-3 call
LOOKALIKE = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"enum": ["search", "flag", "other"]},
                            "parameters": {"type": "object", "additionalProperties": False,
                                           "properties": {"query": {"type": "string",
                                                                    "maxLength": 4}}}}}
FAMILIES = ["hermes", "llama3_json"]


def make_tok(markers_are_tokens: bool):
    tok = make_tokenizer()
    if markers_are_tokens:
        tok.add_tokens([AddedToken(m, special=False) for m in ("<tool_call>", "</tool_call>")])
    return tok


def grammar_of(tok, family: str, answer: dict, parallel: bool = True) -> StructuredOutput:
    req = parse_tool_request({"tools": TOOLS, "parallel_tool_calls": parallel})
    parser = get_parser(family)
    return StructuredOutput.lark(answer_or_calls_grammar(
        parser, StructuredOutput.json_schema(answer), req.call_schema(parser.ARGS_KEY),
        req.parallel, tok.get_added_vocab()))


def accepts(compiler, grammar: str, tok, text: str) -> bool:
    state = compiler.matcher(grammar)
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(EOS)]
    return all(state.accept(t) for t in ids) and state.terminated


@pytest.mark.parametrize("markers_are_tokens", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_both_branches_are_allowed_and_read_back(family, markers_are_tokens):
    tok = make_tok(markers_are_tokens)
    compiler = GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids(EOS)])
    grammar = compiler.compile(grammar_of(tok, family, LOOKALIKE))
    parser = AnswerOrCallsParser(get_parser(family))
    call = {"hermes": '<tool_call>\n{"name": "search", "arguments": {"query": "kv"}}\n'
                      '</tool_call>',
            "llama3_json": '{"name": "search", "parameters": {"query": "kv"}}'}[family]
    answer = '{"name":"search","parameters":{"query":"kv"}}'  # compact: never a call
    assert accepts(compiler, grammar, tok, call)
    assert accepts(compiler, grammar, tok, answer)
    out = parser.parse(call)
    assert out.content == "" and [(c.name, c.arguments) for c in out.calls] == \
        [("search", {"query": "kv"})]
    out = parser.parse(answer)
    assert out.calls == [] and out.content == answer
    # neither a spaced answer, nor a call to a tool not listed, nor both, nor text
    assert not accepts(compiler, grammar, tok, '{"name": "other", "parameters": {}}')
    assert not accepts(compiler, grammar, tok, call.replace("search", "other"))
    assert not accepts(compiler, grammar, tok, answer + "\n" + call)
    assert not accepts(compiler, grammar, tok, "Let me look.")


def test_the_answer_is_compact_whatever_the_schema_asks():
    """A schema's own ``x-guidance`` separators would let an answer start like a call."""
    tok = make_tok(False)
    compiler = GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids(EOS)])
    loose = {**LOOKALIKE, "x-guidance": {"whitespace_flexible": True, "key_separator": ": "}}
    grammar = compiler.compile(grammar_of(tok, "llama3_json", loose))
    assert accepts(compiler, grammar, tok, '{"name":"other","parameters":{}}')
    assert not accepts(compiler, grammar, tok, '{"name": "other", "parameters": {}}')


@pytest.mark.parametrize("reply, content, calls", [
    ('{"name":"search","parameters":{"query":"x"}}',
     '{"name":"search","parameters":{"query":"x"}}', []),
    ('{"name": "search", "parameters": {"query": "x"}}', "", [("search", {"query": "x"})]),
    ('{"name": "flag", "parameters": {}}; {"name": "search", "parameters": {"query": "y"}}', "",
     [("flag", {}), ("search", {"query": "y"})]),
    ('{"answer":1}', '{"answer":1}', []),
])
def test_llama3_replies_are_told_apart_by_their_first_characters(reply, content, calls):
    out = AnswerOrCallsParser(get_parser("llama3_json")).parse(reply)
    assert out.content == content and [(c.name, c.arguments) for c in out.calls] == calls


def random_walk(compiler, grammar: str, tok, rng: random.Random, start: str) -> list[int]:
    """The tokens of ``start``, then tokens the grammar allows, until it completes; without
    the EOS."""
    eos = tok.convert_tokens_to_ids(EOS)
    out = walk(compiler.matcher(grammar), len(tok), eos, rng,
               start=tok.encode(start, add_special_tokens=False), limit=3000)
    return out[:-1] if out[-1] == eos else out


def token_pieces(tok, ids: list[int], text: str) -> list[str]:
    """The text each token adds, as a stream sends it (a character split across tokens
    waits for its last byte)."""
    pieces, sent = [], ""
    for i in range(len(ids)):
        prefix = tok.decode(ids[:i + 1])
        if text.startswith(prefix):
            pieces.append(prefix[len(sent):])
            sent = prefix
    return pieces


def streamed(parser, text: str, pieces: list[str]):
    """(content, {index: (name, arguments)}) added up from a stream of ``pieces``."""
    s = ToolCallStream(parser, "req-1")
    content, calls = "", {}
    final = parser.parse(text)
    final.calls = number_calls(final.calls, "req-1")
    for piece in [s.push(p) for p in pieces] + [s.finish(final)]:
        content += piece.content
        for d in piece.calls:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.name or ""), args + d.arguments)
    return content, calls


@pytest.mark.parametrize("answer", [LOOKALIKE, {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
    "additionalProperties": False}], ids=["lookalike", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_output_is_a_valid_answer_or_valid_calls(family, answer):
    tok = make_tok(family == "hermes")
    compiler = GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids(EOS)])
    grammar = compiler.compile(grammar_of(tok, family, answer))
    parser = AnswerOrCallsParser(get_parser(family))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(0)
    seen = set()
    for k in range(24):
        start = ["", "{", parser.CALL_PREFIX][k % 3]
        ids = random_walk(compiler, grammar, tok, rng, start)
        text = tok.decode(ids)
        out = parser.parse(text)
        if out.calls:
            assert out.content == "" and text.startswith(parser.CALL_PREFIX)
            for c in out.calls:
                jsonschema.validate(c.arguments, schemas[c.name])
        else:
            jsonschema.validate(json.loads(out.content), answer)
        seen.add(bool(out.calls))
        content, calls = streamed(parser, text, token_pieces(tok, ids, text))
        assert content == out.content
        assert [(n, json.loads(a)) for n, a in calls.values()] == \
            [(c.name, c.arguments) for c in out.calls]
    assert seen == {True, False}
