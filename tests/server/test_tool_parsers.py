"""Tool-call parsers on replies in the shape real models write them, whole and streamed."""

from __future__ import annotations

import json

import pytest
from deepinfer.server.tools import ToolCallStream, detect_parser, get_parser, number_calls
from deepinfer.server.tools.request import parse_tool_request

# (parser, reply text, expected content, expected [(name, arguments)])
RECORDED = [
    # Qwen2.5-Instruct: one call, no text
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>', "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    # Qwen2.5: text first, then two parallel calls
    ("hermes", 'Let me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments":'
               ' {"city": "Rome"}}\n</tool_call>', "Let me check both cities.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    # Hermes-2-Pro: compact JSON, arguments first
    ("hermes", '<tool_call>{"arguments": {"q": "ünïcode \\"quoted\\""}, "name": "search"}</tool_call>',
     "", [("search", {"q": 'ünïcode "quoted"'})]),
    # EOS before the closing tag
    ("hermes", '<tool_call>\n{"name": "ls", "arguments": {}}', "", [("ls", {})]),
    # malformed JSON stays content
    ("hermes", '<tool_call>\n{"name": "ls", "arguments": {oops}\n</tool_call>',
     '<tool_call>\n{"name": "ls", "arguments": {oops}\n</tool_call>', []),
    # plain answer
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    # Llama-3.1-Instruct (JSON tool calling)
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                    '{"name": "b", "parameters": {"y": [1, 2]}}', "",
     [("a", {"x": 1}), ("b", {"y": [1, 2]})]),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}} and some text',
     '{"name": "a", "parameters": {"x": 1}} and some text', []),
]


@pytest.mark.parametrize("family, text, content, calls", RECORDED)
def test_parse_recorded_outputs(family, text, content, calls):
    out = get_parser(family).parse(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls


def _stream(family: str, text: str, step: int):
    """Feed ``text`` in pieces of ``step`` characters; return (content, deltas, final)."""
    s = ToolCallStream(get_parser(family), "req-1")
    content, deltas = "", []
    for i in range(0, len(text), step):
        piece = s.push(text[i:i + step])
        content += piece.content
        deltas += piece.calls
    final = get_parser(family).parse(text)
    final.calls = number_calls(final.calls, "req-1")
    piece = s.finish(final)
    return content + piece.content, deltas + piece.calls, final


def _assembled(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from OpenAI ``tool_calls`` deltas, as a client adds them
    up; each call's first delta carries its id and name, later ones only arguments."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.name
            calls.append([d.id, d.name, ""])
        else:
            assert d.name is None and d.index == len(calls) - 1
        calls[d.index][2] += d.arguments
    return [tuple(c) for c in calls]


# a call followed by text is content in Llama-3's format, which a stream knows only at the end
SPECULATIVE = {'{"name": "a", "parameters": {"x": 1}} and some text'}


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("family, text, content, calls", RECORDED)
def test_streamed_pieces_add_up_to_the_final_parse(family, text, content, calls, step):
    if text in SPECULATIVE:
        pytest.skip("streamed as a call before the trailing text shows it is none")
    got_content, deltas, final = _stream(family, text, step)
    assert got_content == final.content == content
    assert _assembled(deltas) == [(c.id, c.name, c.arguments_json) for c in final.calls]
    assert [json.loads(c.arguments_json) for c in final.calls] == [a for _, a in calls]


@pytest.mark.parametrize("family, text, content, calls", [r for r in RECORDED if r[3]])
def test_arguments_stream_as_the_model_writes_them(family, text, content, calls):
    """Fed one character at a time, every call's arguments arrive in several fragments, the
    first one with the call's header, before the call is complete (when the model writes the
    name first: Hermes-2-Pro's arguments-first calls wait for their name)."""
    _, deltas, final = _stream(family, text, 1)
    name_first = text.index('"name"') < text.index('"%s"' % get_parser(family).ARGS_KEY)
    for i, c in enumerate(final.calls):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id == c.id and mine[0].name == c.name
        if len(c.arguments_json) > 2 and name_first:
            assert len([d for d in mine if d.arguments]) > 2


def test_hermes_call_is_announced_once_its_name_is_written():
    s = ToolCallStream(get_parser("hermes"), "r")
    assert s.push("Sure. <tool").content == "Sure."  # "<tool" could open a call: held
    assert s.push('_call>{"name": "a", "argu').calls == []  # no arguments yet
    piece = s.push('ments": {"k": "v')
    assert [(d.name, d.arguments) for d in piece.calls] == [("a", '{"k": "v')]
    assert [(d.id, d.arguments) for d in s.push('w"}}</tool_call>').calls] == [(None, 'w"}')]
    assert s.push("\n<tool_call>").calls == []


def test_ids_depend_only_on_request_and_index():
    a = number_calls(get_parser("hermes").parse(RECORDED[1][1]).calls, "r1")
    b = number_calls(get_parser("hermes").parse(RECORDED[1][1]).calls, "r1")
    c = number_calls(get_parser("hermes").parse(RECORDED[1][1]).calls, "r2")
    assert [x.id for x in a] == [x.id for x in b] and a[0].id != a[1].id and a[0].id != c[0].id
    assert number_calls(a, "r1", "toolu_", limit=1)[0].id.startswith("toolu_")


def test_detect_parser_from_template():
    assert detect_parser("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_parser("{% if tools %}Environment: ipython <|python_tag|>{% endif %}") == \
        "llama3_json"
    assert detect_parser("{{ messages }}") is None  # no tools in the template
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_call_schema_of_a_named_choice_validates_the_call():
    import jsonschema

    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
        for n in ("a", "b")]
    named = parse_tool_request({"tools": tools, "tool_choice": {"type": "function",
                                                                "function": {"name": "b"}}})
    jsonschema.validate({"name": "b", "arguments": {"x": 1}}, named.call_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "arguments": {"x": 1}}, named.call_schema())
    required = parse_tool_request({"tools": tools, "tool_choice": "required"})
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, required.call_schema())


@pytest.mark.parametrize("markers_are_tokens", [False, True])
@pytest.mark.parametrize("family, good, wrong_name", [
    ("hermes", '<tool_call>\n{"name": "b", "arguments": {"x": 3}}\n</tool_call>',
     '<tool_call>\n{"name": "a", "arguments": {"x": 3}}\n</tool_call>'),
    ("llama3_json", '{"name": "b", "parameters": {"x": 3}}', '{"name": "a", "parameters": {"x": 3}}'),
])
def test_call_grammar_accepts_exactly_what_the_parser_reads(family, good, wrong_name,
                                                            markers_are_tokens):
    """tool_choice required / named: the family's grammar, compiled by llguidance (the
    structured-output library), accepts a call of the named tool that ``parse`` reads back,
    and rejects another tool; with the call markers as text or as added tokens (Qwen)."""
    llguidance = pytest.importorskip("llguidance")
    import llguidance.hf
    from tiny_checkpoints import make_tokenizer
    from transformers import AddedToken

    tok = make_tokenizer()
    if markers_are_tokens:
        tok.add_tokens([AddedToken(m, special=False) for m in ("<tool_call>", "</tool_call>")])
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
        for n in ("a", "b")]
    req = parse_tool_request({"tools": tools, "tool_choice": {"type": "function",
                                                              "function": {"name": "b"}}})
    parser = get_parser(family)
    grammar = llguidance.LLMatcher.grammar_from_lark(
        parser.call_grammar(req.call_schema(parser.ARGS_KEY), False, tok.get_added_vocab()))
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) \
            and m.is_accepting()

    assert accepts(good) and not accepts(wrong_name) and not accepts("plain text")
    assert [(c.name, c.arguments) for c in parser.parse(good).calls] == [("b", {"x": 3})]
