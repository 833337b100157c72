"""What shape a request's output must have: JSON (any object, or a JSON schema), a regex, or
a Lark grammar (which may embed JSON schemas: ``%json {...}``, e.g. for tool calls).

A spec is plain data (kind + canonical text), frozen and hashable, so the compiled grammar
can be cached per spec; it is checked for shape here and compiled (which finds the deeper
errors) when the request is added to the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from ..errors import RequestError

Kind = Literal["json_object", "json_schema", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "lark")

FIELD = "structured_output"  # the SamplingParams field; the server maps it to its own name


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` and its ``spec`` text: a JSON schema as canonical JSON, a regex, or a Lark
    grammar (llguidance's dialect: rule ``start``; ``%json {schema}`` embeds a JSON schema);
    empty for json_object."""

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(FIELD, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise RequestError(FIELD, "spec must be a string")
        if self.kind != "json_object" and not self.spec.strip():
            raise RequestError(FIELD, f"a {self.kind} constraint needs a non-empty spec")

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        if not isinstance(schema, (dict, bool)):
            raise RequestError(FIELD, "a JSON schema must be an object")
        return cls("json_schema", _canonical(schema))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        """A Lark grammar, e.g. for a required tool call::

            start: "<tool_call>\\n" %json {"type": "object", ...} "\\n</tool_call>"
        """
        return cls("lark", grammar)


def _canonical(obj: object) -> str:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise RequestError(FIELD, f"must be JSON-serialisable: {e}") from None
