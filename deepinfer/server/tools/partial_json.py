"""A tool call's JSON object while the model is still writing it: its name once complete, and
the part of its arguments written so far, as raw text, so a stream can send argument fragments
token by token that add up to the arguments as written (``ToolCall.arguments_text``)."""

from __future__ import annotations

import json
import re

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def value_end(text: str, start: int) -> int | None:
    """End of the JSON object or array that starts at ``text[start]`` (None: not closed yet)."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def args_span(obj_text: str, key: str) -> tuple[int, int | None] | None:
    """Where the object value of ``"key":`` lies in a call object's text (end None: still
    open); None if the key is not written yet or its value is not an object."""
    m = re.search(r'"%s"\s*:\s*' % re.escape(key), obj_text)
    if m is None or not obj_text[m.end():m.end() + 1] == "{":
        return None
    return m.end(), value_end(obj_text, m.end())


def valid_prefix_len(text: str) -> int:
    """Length of the longest prefix of ``text`` that is surely the start of valid JSON (a
    literal or a number being written, or a malformed part, is held back)."""
    try:
        json.loads(text)
        return len(text)
    except json.JSONDecodeError as e:
        return len(text) if e.msg.startswith("Unterminated string") else min(e.pos, len(text))


def partial_call(obj_text: str, key: str) -> tuple[str, str] | None:
    """(name, arguments written so far) of a call object being written; None until its name
    is complete and its arguments have started as a valid JSON object."""
    name = _NAME.search(obj_text)
    span = args_span(obj_text, key)
    if name is None or span is None:
        return None
    start, end = span
    args = obj_text[start:end] if end is not None else obj_text[start:]
    n = valid_prefix_len(args)
    if n < 2:  # only "{": a malformed call is not announced
        return None
    return json.loads(f'"{name.group(1)}"'), args[:n]


def written_arguments(obj_text: str, key: str, arguments: dict) -> str | None:
    """The arguments as written in a complete call object, if they parse to ``arguments``."""
    span = args_span(obj_text, key)
    if span is None or span[1] is None:
        return None
    raw = obj_text[span[0]:span[1]]
    try:
        return raw if json.loads(raw) == arguments else None
    except ValueError:
        return None
