"""The grammars of DeepSeek-V4 / V4.1 replies, in llguidance's Lark dialect: a reply that must
be DSML tool calls (``tool_choice`` ``required`` or a named function: ``dsml_call_grammar``),
and one whose answer must follow ``response_format`` (``dsml_reply_grammar``: free reasoning
when thinking is on, then JSON or, with ``tool_choice`` auto, a DSML call block).

The prompt the official encoding builds for a forced choice ends inside the call block
(``...<｜DSML｜tool_calls>\\n``), so the reply is one or more invokes and the block's end tag,
written exactly as deepseek-recipe renders a call back into history (and as its stream parser
reads one):

    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V4.1 spells the tags `` calls`` / `` invoke`` / `` parameter`` (a space after the DSML token)
and writes an invoke without parameters with an empty line. The DSML marker is one special
token, written ``<[id]>``, so no text the model writes can fake a tag.

Each tool's parameters follow its JSON schema: declared properties in schema order, the
required ones always, no others. A property whose schema is a plain string (or an enum /
const of strings) is written raw (``string="true"``), any text, as the model was trained to;
any other property (a number, an object, a string with a ``pattern`` or length bounds, ...)
as compact JSON under its own schema (``%json``, ``", "`` / ``": "`` separators, as the
encoding renders values back), so the parsed arguments always validate. A string written as
JSON is rendered raw in the next turn's history: that turn's prompt is then re-rendered
(``history_rewritten``), which costs a cache miss from that reply on, never correctness.
A top-level keyword the grammar cannot express (``anyOf``, ``minProperties``, ...) is a 400
naming the tool's ``parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...errors import RequestError
from .parsers import json_rule

# top-level keywords of a tool's parameters schema the grammar honours or may ignore
_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title",
                "$defs", "definitions", "$schema", "$id", "$comment", "default", "examples",
                "strict"}
# keywords of a string schema that leave it writable raw (annotations, enum / const)
_RAW_STRING_KEYS = {"type", "description", "title", "default", "examples", "$comment",
                    "deprecated", "readOnly", "writeOnly", "enum", "const"}
_TRUE, _FALSE = '"true">', '"false">'  # how a parameter's open tag ends: raw or JSON value
# a response_format answer: compact JSON, as the engine writes it for every model
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class DsmlSyntax:
    """How one model version spells the call block (the text after the DSML token)."""

    calls: str
    invoke: str
    parameter: str
    empty_invoke: str  # what an invoke without parameters holds between its tags


V4 = DsmlSyntax("tool_calls", "invoke", "parameter", "\n")
V41 = DsmlSyntax(" calls", " invoke", " parameter", "\n\n")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Builder:
    """Collects the Lark rules of one grammar (one rule per invoke and per parameter)."""

    def __init__(self, syntax: DsmlSyntax, dsml: str) -> None:
        self.s, self.d = syntax, dsml
        self.rules: list[str] = []

    def close(self, tag: str) -> str:
        """``</DSML tag>``: "<" and "/" are lexemes of their own, as in raw values."""
        return f'"<" "/" {self.d} {_lit(tag + ">")}'

    def param(self, name: str, key: str, schema: object, defs: dict) -> str:
        head = f'"<" {self.d} {_lit(f"{self.s.parameter} name={json.dumps(key)} string=")}'
        raw = _raw_values(schema)
        if raw is not None:
            value = " | ".join(_lit(v) for v in raw) if raw else "raw_text"
            body = f'{_lit(_TRUE)} ({value})'
        else:
            sub = schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
            body = f'{_lit(_FALSE)} %json {json_rule({**defs, **sub})}'
        self.rules.append(f"{name}: {head} {body} {self.close(self.s.parameter)}")
        return name

    def invoke(self, k: int, fn: dict, where: str) -> str:
        schema = fn.get("parameters") or {"type": "object"}
        extra = sorted(set(schema) - _OBJECT_KEYS)
        if extra:
            raise RequestError(f"{where}.parameters", f"tool_choice required / a named function "
                               f"on DeepSeek-V4 writes calls in DSML, whose grammar cannot "
                               f"enforce {', '.join(extra)}; leave it out or use tool_choice auto")
        props = dict(schema.get("properties") or {})
        required = list(schema.get("required") or [])
        for key in required:  # required but not declared: any JSON value
            props.setdefault(key, {})
        defs = {k2: schema[k2] for k2 in ("$defs", "definitions") if k2 in schema}
        params = [(self.param(f"p{k}_{i}", key, sub, defs), key in required)
                  for i, (key, sub) in enumerate(props.items())]
        body = self._params(f"i{k}", params)
        name = json.dumps(fn["name"])
        open_tag = f'"<" {self.d} {_lit(f"{self.s.invoke} name={name}>")}'
        self.rules.append(f"i{k}: {open_tag} {body} {self.close(self.s.invoke)}")
        return f"i{k}"

    def _params(self, name: str, params: list[tuple[str, bool]]) -> str:
        """``"\\n" p ("\\n" p)* "\\n"``, optional ones skippable, or the empty invoke when
        every parameter is optional and none is written (right-recursive rules)."""
        n = len(params)
        for i in range(n - 1, -1, -1):  # rest_i: what follows once a parameter was written
            rule, req = params[i]
            tail = f" {name}_r{i + 1}" if i + 1 < n else ""
            alts = [f'"\\n" {rule}{tail}'] + ([] if req else [tail.strip() or '""'])
            self.rules.append(f"{name}_r{i}: {' | '.join(alts)}")
        for i in range(n - 1, -1, -1):  # first_i: the first parameter written is i or later
            rule, req = params[i]
            tail = f" {name}_r{i + 1}" if i + 1 < n else ""
            alts = [f"{rule}{tail}"]
            if not req and i + 1 < n:
                alts.append(f"{name}_f{i + 1}")
            self.rules.append(f"{name}_f{i}: {' | '.join(alts)}")
        written = f'"\\n" {name}_f0 "\\n"' if n else None
        empty = _lit(self.s.empty_invoke) if all(not req for _, req in params) else None
        return "(" + " | ".join(x for x in (written, empty) if x) + ")"


def _raw_values(schema: object) -> list[str] | None:
    """The schema as raw text: [] for any string, the allowed strings of an enum / const, or
    None when the value must be written as JSON."""
    if not isinstance(schema, dict) or set(schema) - _RAW_STRING_KEYS:
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema \
        else None
    if values is not None:
        ok = all(isinstance(v, str) for v in values) and values
        return list(values) if ok and schema.get("type", "string") == "string" else None
    return [] if schema.get("type") == "string" else None


def _call_rules(b: _Builder, tools: list[dict], parallel: bool, wheres: list[str] | None) -> str:
    """Adds the rules of calls to ``tools`` to ``b``; returns the expression of what follows
    the call block's open tag: the calls and the block's end tag."""
    wheres = wheres or [f"tools[{k}].function" for k in range(len(tools))]
    names = [b.invoke(k, t["function"], wheres[k]) for k, t in enumerate(tools)]
    b.rules.append(f"call: {' | '.join(names)}")
    b.rules.append('raw_text: (RAW_TEXT | "<" | "/")*')
    b.rules.append(r"RAW_TEXT: /[^<\/]+/")
    calls = 'call ("\\n" call)*' if parallel else "call"
    return f'{calls} "\\n" {b.close(b.s.calls)}'


def dsml_call_grammar(syntax: DsmlSyntax, dsml: str, tools: list[dict], parallel: bool,
                      wheres: list[str] | None = None) -> str:
    """The Lark grammar of a reply of calls to ``tools`` (OpenAI function tools), one or
    (``parallel``) more, ending with the block's end tag; ``dsml`` is the marker as a Lark
    item (``<[id]>``), ``wheres`` the request path of each tool for errors."""
    b = _Builder(syntax, dsml)
    start = f"start: {_call_rules(b, tools, parallel, wheres)}"
    return "\n".join([start] + b.rules)


def dsml_reply_grammar(syntax: DsmlSyntax, dsml: str, think_end: str | None, schema: dict,
                       tools: list[dict], parallel: bool, wheres: list[str] | None = None) -> str:
    """The Lark grammar of a whole reply whose answer must follow ``response_format``: with
    thinking on (``think_end``: the end tag as a Lark item), free reasoning text up to that
    tag; then a JSON answer under ``schema`` (compact, as other models' ``response_format``)
    or, when ``tools`` may be called (``tool_choice`` auto), a DSML call block as the encoding
    renders one after an empty content (``"\\n\\n"`` and the block's open tag)."""
    b = _Builder(syntax, dsml)
    answer = f"%json {json.dumps({'x-guidance': _COMPACT_JSON, **schema})}"
    if tools:
        open_tag = f'"\\n\\n" "<" {dsml} {_lit(syntax.calls + ">")} "\\n"'
        answer = f"({answer} | {open_tag} {_call_rules(b, tools, parallel, wheres)})"
    if think_end is not None:  # text only: a special token (EOS, DSML) cannot be reasoning
        b.rules.append(r"REASONING: /(?s:.*)/")
        answer = f"REASONING {think_end} {answer}"
    return "\n".join([f"start: {answer}"] + b.rules)
