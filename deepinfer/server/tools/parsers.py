"""Model output -> tool calls, one parser per chat-template family, and the registry.

A parser reads the reply text the way the family's chat template writes tool calls:

* ``hermes`` (Hermes, Qwen2/2.5/3, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, with text before;
* ``llama3_json`` (Llama 3.1-3.3): the whole reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``.

``parse`` never raises: text that does not hold a well-formed call stays content, as vLLM does.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from .partial_json import partial_call, written_arguments


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""  # set by ``number_calls``
    arguments_text: str | None = None  # the arguments as the model wrote them (valid JSON)

    @property
    def arguments_json(self) -> str:
        """The arguments as sent to the client: as written (so streamed fragments add up to
        it), else re-serialized."""
        if self.arguments_text is not None:
            return self.arguments_text
        return json.dumps(self.arguments, ensure_ascii=False)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}

    def to_message(self) -> dict:
        """The call as it sits in a normalized assistant message (arguments as an object)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolOutput:
    content: str  # text outside the calls ("" when the reply is only calls)
    calls: list[ToolCall]
    reasoning: str | None = None  # a thinking model's reasoning (DeepSeek-V4), apart from content


def number_calls(calls: list[ToolCall], request_id: str, prefix: str = "call_",
                 limit: int | None = None) -> list[ToolCall]:
    """The first ``limit`` calls with ids derived from (request, index): the stream, the final
    response and the remembered reply all name a call the same without sharing state."""
    calls = calls[:limit]
    for i, c in enumerate(calls):
        c.id = call_id(request_id, i, prefix)
    return calls


def call_id(request_id: str, index: int, prefix: str = "call_") -> str:
    return prefix + hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=12).hexdigest()


class ToolParser:
    """One family's tool-call syntax."""

    name = ""
    ARGS_KEY = "arguments"  # the key the family writes a call's arguments under

    CALL_PREFIX = ""  # how every reply the call grammar allows begins (``answer_or_calls``)

    def call_grammar(self, call_schema: dict, parallel: bool,
                     added_tokens: dict[str, int] | None = None) -> str:
        """A Lark grammar (llguidance dialect, ``%json`` embeds a JSON schema) of a reply
        that is only calls matching ``call_schema``: the constraint ``tool_choice`` ``required``
        or a named function puts on the output. ``added_tokens`` (the tokenizer's added
        vocabulary): a marker that is one added token (Qwen's ``<tool_call>``) is written as
        that token, which llguidance keeps apart from text."""
        return "start: calls\n" + self.calls_rules(call_schema, parallel, added_tokens)

    def calls_rules(self, call_schema: dict, parallel: bool,
                    added_tokens: dict[str, int] | None = None) -> str:
        """The Lark rules of ``call_grammar`` but its start: they define ``calls``."""
        raise NotImplementedError

    def parse(self, text: str, final: bool = True) -> ToolOutput:
        """Content and calls of ``text``; with ``final=False`` (a reply still growing) only the
        calls already complete, and content up to the first call."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """Length of the leading part of a growing reply that is surely content (no call
        starts in it), so a stream can send it before the reply is complete."""
        raise NotImplementedError

    def partial_call(self, text: str) -> tuple[str, str] | None:
        """(name, arguments written so far) of the call a growing reply ends inside, after
        the calls ``parse(text, final=False)`` returns; None if it ends inside none (or the
        call's name is not complete yet). The arguments are a prefix of the call's
        ``arguments_text`` once complete."""
        raise NotImplementedError


def _call_from(obj: object, args_key: str, obj_text: str = "") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    key = args_key if args_key in obj else "arguments"
    return ToolCall(obj["name"], args, arguments_text=written_arguments(obj_text, key, args))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    CALL_PREFIX = START
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool = True) -> ToolOutput:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        pos = 0
        for m in self._BLOCK.finditer(text):
            call = self._decode(m.group(1))
            if call is None:
                continue  # malformed: its text stays content
            calls.append(call)
            pieces.append(text[pos:m.start()])
            pos = m.end()
        rest = text[pos:]
        if final and self.START in rest:  # a last call the model did not close (EOS first)
            head, _, body = rest.partition(self.START)
            call = self._decode(body)
            if call is not None:
                calls.append(call)
                rest = head
        elif not final and self.START in rest:
            rest = rest[:rest.index(self.START)]
        pieces.append(rest)
        return ToolOutput(_join_content(pieces) if calls else text.strip(), calls)

    def calls_rules(self, call_schema: dict, parallel: bool,
                    added_tokens: dict[str, int] | None = None) -> str:
        start, end = (_literal(m, added_tokens or {}) for m in (self.START, self.END))
        call = f'{start} "\\n" %json {json_rule(call_schema)} "\\n" {end}'
        return _calls(call, '"\\n"', parallel)

    def content_end(self, text: str) -> int:
        i = text.find(self.START)
        return i if i >= 0 else len(text) - _held_prefix(text, self.START)

    def partial_call(self, text: str) -> tuple[str, str] | None:
        i = text.rfind(self.START)
        if i < 0 or self.END in text[i:]:
            return None
        return partial_call(text[i + len(self.START):], "arguments")

    @staticmethod
    def _decode(body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body.strip()), "arguments", body.strip())
        except ValueError:
            return None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    ARGS_KEY = "parameters"
    CALL_PREFIX = '{"name": '  # ``json_rule``'s key separator: compact JSON never writes it
    TAG = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def calls_rules(self, call_schema: dict, parallel: bool,
                    added_tokens: dict[str, int] | None = None) -> str:
        return _calls(f"%json {json_rule(call_schema)}", '"; "', parallel)

    def parse(self, text: str, final: bool = True) -> ToolOutput:
        """While the reply grows (``final=False``), the calls complete so far: a reply that
        starts as calls is streamed as calls (the family's format decides only at the end)."""
        body = self._body(text)
        if not body.startswith("{"):
            return ToolOutput("" if self._starts_call(text) else text.strip(), [])
        calls, i = self._complete_calls(body)
        if final and i < len(body):
            return ToolOutput(text.strip(), [])
        return ToolOutput("", calls)

    def partial_call(self, text: str) -> tuple[str, str] | None:
        body = self._body(text)
        if not body.startswith("{"):
            return None
        _, i = self._complete_calls(body)
        rest = body[i:]
        return partial_call(rest, self.ARGS_KEY) or partial_call(rest, "arguments")

    def _body(self, text: str) -> str:
        body = text.strip()
        return body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body

    def _complete_calls(self, body: str) -> tuple[list[ToolCall], int]:
        """The calls at the start of ``body`` and where the rest (not a call) begins."""
        calls, i = [], 0
        while i < len(body):
            try:
                obj, end = self._decoder.raw_decode(body, i)
            except ValueError:
                break
            call = _call_from(obj, "parameters", body[i:end])
            if call is None:
                break
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return calls, i

    def content_end(self, text: str) -> int:
        return 0 if self._starts_call(text) else len(text)

    def _starts_call(self, text: str) -> bool:
        """Could this reply be (the start of) a call? Then nothing of it is sent as content yet."""
        body = text.lstrip()
        return (not body or body.startswith("{") or body.startswith(self.TAG)
                or self.TAG.startswith(body))


def json_rule(schema: dict) -> str:
    """``%json`` body: the schema, with JSON written as chat templates' ``tojson`` writes it
    (fixed ", " and ": " separators, no free whitespace: a model cannot pad forever, and the
    call renders back identically, so the next turn extends this one in the cache)."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False,
                                                "item_separator": ", ", "key_separator": ": "}})


def _calls(call: str, separator: str, parallel: bool) -> str:
    """Rules ``calls``: one ``call``, or (``parallel``) several apart by ``separator``."""
    calls = f"call ({separator} call)*" if parallel else "call"
    return f"calls: {calls}\ncall: {call}"


def _literal(marker: str, added_tokens: dict[str, int]) -> str:
    """A call marker in a Lark grammar: the added token (``<[id]>``) if it is one, else text."""
    tid = added_tokens.get(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker)


def _join_content(pieces: list[str]) -> str:
    return "\n".join(p.strip() for p in pieces if p.strip())


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}
# DeepSeek-V4's DSML: parsed from token ids by deepseek-recipe (``server/deepseek_encoding.py``)
DSML_PARSER = "deepseek_v4"


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


def detect_parser(chat_template: str | None) -> str | None:
    """The parser family a chat template writes tool calls in; None if it renders no tools."""
    t = chat_template or ""
    if "tools" not in t:
        return None
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return None


def resolve_parser(name: str | None, chat_template: str | None) -> ToolParser | None:
    """``--tool-call-parser``: a family name, or None / ``auto`` to detect it from the template."""
    if name in (None, "auto"):
        name = detect_parser(chat_template)
        return get_parser(name) if name else None
    return get_parser(name)
