"""``tools``, ``tool_choice``, ``parallel_tool_calls`` and the tool fields of chat messages.

Checked by hand like the rest of the protocol, so a bad schema is a 400 naming the field
(``tools[1].function.parameters``): a ``RequestError``, which the protocol answers as 400.
Normalized shapes are what chat templates expect (HF's
``tools=`` argument and assistant ``tool_calls`` with ``arguments`` as an object), and are
canonical: a reply we returned and the client sends back normalizes to the same message, which
is what lets the prefix-stable chat encoding find it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema

from ...errors import RequestError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    tools: list[dict] = field(default_factory=list)  # [{"type": "function", "function": {...}}]
    choice: str = "auto"  # "none" | "auto" | "required" | "function" (a named one)
    function_name: str | None = None  # for choice == "function"
    parallel: bool = True

    @property
    def parse_calls(self) -> bool:
        """Is the reply parsed into tool calls? (``none``: tools stay in the prompt, so the
        cached prefix is the same as on other turns, but the reply is plain content.)"""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """``required`` or a named function: the reply must be calls (grammar-constrained)."""
        return bool(self.tools) and self.choice in ("required", "function")

    def call_schema(self, args_key: str = "arguments") -> dict:
        """JSON schema of one call object ``{"name", args_key}`` that ``tool_choice``
        ``required`` (any tool) or a named function allows: what a grammar-constrained decoder
        enforces inside the parser family's call markers (``ToolParser.call_grammar``)."""
        fns = [t["function"] for t in self.tools
               if self.choice != "function" or t["function"]["name"] == self.function_name]
        alts = [{"type": "object", "required": ["name", args_key], "additionalProperties": False,
                 "properties": {"name": {"const": f["name"]},
                                args_key: f.get("parameters") or {"type": "object"}}}
                for f in fns]
        return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _check_schema(schema: object, where: str) -> None:
    if not isinstance(schema, dict):
        raise RequestError(where, "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise RequestError(f"{where}{path}", f"is not a valid JSON Schema: {e.message}") from None
    if schema.get("type", "object") != "object":
        raise RequestError(f"{where}.type", f"must be \"object\" (tool arguments are an object), "
                                   f"got {json.dumps(schema.get('type'))}")


def _parse_tool(t: object, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise RequestError(where, "must be an object {\"type\": \"function\", \"function\": {...}}")
    if t.get("type", "function") != "function":
        raise RequestError(f"{where}.type", f"only \"function\" tools are supported, got "
                                   f"{json.dumps(t.get('type'))}")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function", "must be an object with 'name' (and 'parameters')")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RequestError(f"{where}.function.name",
                           "must be 1-64 characters of a-z, A-Z, 0-9, _, . or -")
    out = {"name": name}
    desc = fn.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise RequestError(f"{where}.function.description", "must be a string")
        out["description"] = desc
    params = fn.get("parameters")
    if params is not None:
        _check_schema(params, f"{where}.function.parameters")
        out["parameters"] = params
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise RequestError(f"{where}.function.strict", "must be a boolean")
    return {"type": "function", "function": out}


def _parse_choice(v: object, names: list[str]) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if names else "none"), None
    if isinstance(v, str):
        if v not in CHOICES:
            raise RequestError("tool_choice", f"must be one of {', '.join(CHOICES)} or a named "
                                              f"function, got {json.dumps(v)}")
        return v, None
    fn = v.get("function") if isinstance(v, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice", "a named choice is "
                                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise RequestError("tool_choice.function.name",
                           f"{json.dumps(name)} is not among the tools")
    return "function", name


def parse_tool_request(body: dict) -> ToolRequest:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` of an OpenAI chat body."""
    if body.get("functions") is not None:
        raise RequestError("functions",
                           "the deprecated 'functions' field is not supported; use 'tools'")
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise RequestError("tools", "must be an array of tool objects")
    tools = [_parse_tool(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise RequestError(f"tools[{i}].function.name", f"{json.dumps(n)} is given twice")
    if body.get("tool_choice") is not None and not tools:
        raise RequestError("tool_choice", "is only allowed when tools are given")
    choice, fname = _parse_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", "must be a boolean")
    return ToolRequest(tools, choice, fname, parallel)


# ---------------------------------------------------------------------- message fields
def _arguments(v: object, where: str) -> dict:
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except ValueError:
            raise RequestError(where, "must be a JSON object (as a string or an object)") from None
    if not isinstance(v, dict):
        raise RequestError(where, "must be a JSON object (as a string or an object)")
    return v


def _tool_call(c: object, where: str) -> dict:
    if not isinstance(c, dict):
        raise RequestError(where, "must be an object "
                                  "{\"id\", \"type\": \"function\", \"function\": {...}}")
    if c.get("type", "function") != "function":
        raise RequestError(f"{where}.type", "must be \"function\"")
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"{where}.function.name", "must be a non-empty string")
    cid = c.get("id")
    if not isinstance(cid, str) or not cid:
        raise RequestError(f"{where}.id", "must be a non-empty string")
    args = _arguments(fn.get("arguments"), f"{where}.function.arguments")
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def tool_message_fields(m: dict, where: str) -> dict:
    """The tool fields of one chat message, normalized: an assistant's ``tool_calls``, a tool
    result's ``tool_call_id`` (and ``name``)."""
    role, out = m.get("role"), {}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls", "must be an array")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    elif role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise RequestError(f"{where}.tool_call_id", "is required for a tool message")
        out["tool_call_id"] = cid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out
