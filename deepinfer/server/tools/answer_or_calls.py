"""``tool_choice: auto`` with ``response_format``: the reply is either the format's JSON answer
or tool calls, never both, and each branch is held to its schema (the calls to their tools').

One grammar allows both branches, and the reply's first characters say which one it took:

* ``hermes``: calls start with the ``<tool_call>`` marker, which no JSON value starts with;
* ``llama3_json``: a call is itself a JSON object, ``{"name": "<tool>", "parameters": {...}}``.
  The call branch writes it as chat templates' ``tojson`` does (``": "`` after a key) and the
  answer branch writes compact JSON (``":"``, no whitespace: the separators are forced even if
  the schema's ``x-guidance`` asks for others), so a reply starting ``{"name": `` is a call and
  any other is the answer, even when the answer schema itself has ``name`` and ``parameters``.

``AnswerOrCallsParser`` reads a reply by that rule: a reply that does not start with the
family's ``CALL_PREFIX`` is content as written (an answer that happens to look like a call
stays the answer); one that does is parsed by the family's parser.
"""

from __future__ import annotations

import json

from ...structured.spec import StructuredOutput
from .parsers import ToolOutput, ToolParser

# how the answer branch writes JSON (as ``response_format`` alone does, see structured/grammar)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def answer_schema(so: StructuredOutput) -> dict:
    """The JSON schema of a ``response_format`` constraint (json_object: any object)."""
    return {"type": "object"} if so.kind == "json_object" else json.loads(so.spec)


def answer_or_calls_grammar(parser: ToolParser, answer: StructuredOutput, call_schema: dict,
                            parallel: bool, added_tokens: dict[str, int] | None = None) -> str:
    """The Lark grammar of a reply that is the ``answer`` JSON or calls matching
    ``call_schema`` in ``parser``'s family syntax."""
    schema = answer_schema(answer)
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **COMPACT_JSON}}
    return (f"start: answer | calls\nanswer: %json {json.dumps(schema)}\n"
            + parser.calls_rules(call_schema, parallel, added_tokens))


class AnswerOrCallsParser(ToolParser):
    """A family's parser, for replies of ``answer_or_calls_grammar``: calls only where the
    reply starts with the family's call prefix."""

    def __init__(self, family: ToolParser) -> None:
        self.family = family
        self.name, self.ARGS_KEY = family.name, family.ARGS_KEY
        self.CALL_PREFIX = family.CALL_PREFIX

    def calls_rules(self, call_schema: dict, parallel: bool,
                    added_tokens: dict[str, int] | None = None) -> str:
        return self.family.calls_rules(call_schema, parallel, added_tokens)

    def _branch(self, text: str) -> str:
        """"calls", "answer", or "open" while ``text`` is still a prefix of the call prefix."""
        if text.startswith(self.CALL_PREFIX):
            return "calls"
        return "open" if self.CALL_PREFIX.startswith(text) else "answer"

    def parse(self, text: str, final: bool = True) -> ToolOutput:
        branch = self._branch(text)
        if branch == "calls":
            return self.family.parse(text, final)
        return ToolOutput("" if branch == "open" and not final else text.strip(), [])

    def content_end(self, text: str) -> int:
        branch = self._branch(text)
        if branch == "calls":
            return self.family.content_end(text)
        return 0 if branch == "open" else len(text)

    def partial_call(self, text: str) -> tuple[str, str] | None:
        return self.family.partial_call(text) if self._branch(text) == "calls" else None
